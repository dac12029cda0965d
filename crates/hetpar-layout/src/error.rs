//! The user-facing error of this crate: a bad config, layout or manifest, in one line.

use thiserror::Error;

/// A rejected user input. `field` names where it is (a config path such as
/// `modules.llm.parallel`), `message` says what is wrong with the numbers involved.
/// Displays as one line: `modules.llm.parallel: tp(4) * cp(2) * pp(1) = 8 does not divide ...`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{field}: {message}")]
pub struct ConfigError {
    /// Dotted path of the offending field or table.
    pub field: String,
    /// What is wrong, with the values.
    pub message: String,
}

impl ConfigError {
    /// An error about `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError { field: field.into(), message: message.into() }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = ConfigError> = std::result::Result<T, E>;
