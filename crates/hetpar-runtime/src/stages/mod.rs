//! The stages of each module kind.

pub mod encoder;
pub mod llama;
