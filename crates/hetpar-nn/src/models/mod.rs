//! Models built from the parallel layers.

pub mod llama;
pub mod vit;
