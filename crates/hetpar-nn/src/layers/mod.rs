//! Parallel layers.

pub mod attention;
pub mod comm;
pub mod embedding;
pub mod linear;
pub mod loss;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod rope;

#[cfg(test)]
mod tests;
