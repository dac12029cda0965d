//! hetpar-nn: the compute side. Tensor-, sequence-, context- and expert-parallel layers with
//! Megatron semantics on candle, collectives from the `Communicator`, layout-independent
//! initialization, and the models built from them (a ViT encoder with projector, a
//! Llama-style LLM, dense or MoE). A layer never decides a layout: it receives its shard
//! description and communicators in a [`ParallelCtx`].

pub mod bench;
pub mod ctx;
pub mod error;
pub mod init;
pub mod io;
pub mod kernels;
pub mod layers;
pub mod models;
pub mod ops;
pub mod params;
#[cfg(feature = "testing")]
pub mod testing;

pub use ctx::{Group, ParallelCtx};
pub use error::{NnError, Result};
pub use init::Init;
pub use layers::linear::Build;
pub use params::{HasParams, Param, ShardSpec, Split};
