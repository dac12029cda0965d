//! Models built from the parallel layers.

pub mod audio;
mod encoder;
pub mod llama;
pub mod vit;
