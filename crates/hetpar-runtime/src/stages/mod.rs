//! The stages of each module kind.

pub mod llama;
