//! Why reading or writing data failed.

use std::path::PathBuf;

use thiserror::Error;

/// A data error, naming the file and, where there is one, the record.
#[derive(Debug, Error)]
pub enum DataError {
    /// A file could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said (in the message, not as a source, so that a chain of
        /// causes says it once).
        error: std::io::Error,
    },
    /// A file is not in the format it should be (a LLaVA JSON list, a tokenizer.json).
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What the parser said (with line and column).
        message: String,
    },
    /// One record is unusable.
    #[error("{path}: record {index} (id {id:?}): {message}")]
    Record {
        /// The file.
        path: PathBuf,
        /// Position of the record in the list.
        index: usize,
        /// Its `id`.
        id: String,
        /// What is wrong.
        message: String,
    },
    /// Encoding an image or a clip failed.
    #[error("{path}: {message}")]
    Encode {
        /// The file being written.
        path: PathBuf,
        /// What the encoder said.
        message: String,
    },
    /// Bad options.
    #[error("{0}")]
    Options(String),
}

/// Shorthand.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// An I/O error on `path`.
pub(crate) fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |error| DataError::Io { path: path.to_path_buf(), error }
}
