//! The error type of braid-nn: kernel and comm errors wrapped with the layer and step
//! they came from, plus configuration and input errors that say exactly what is wrong.

/// Result of a braid-nn call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, and where: `context` names the layer (its parameter prefix, e.g.
/// `blocks.3.self_attn`) and the step (`q_proj forward`, `attention backward`).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A kernel op failed.
    #[error("{context}: {source}")]
    Kernel {
        context: String,
        #[source]
        source: braid_kernels::Error,
    },

    /// A collective failed.
    #[error("{context}: {source}")]
    Comm {
        context: String,
        #[source]
        source: braid_comm::CommError,
    },

    /// A layer configuration that cannot work (`what` is the config type, e.g.
    /// `AttentionDims`; `msg` says which fields disagree and how).
    #[error("invalid {what}: {msg}")]
    Config { what: &'static str, msg: String },

    /// A checkpoint file that cannot be used: the file, the tensor (empty when the
    /// problem is the file itself) and what is wrong.
    #[error("{}{}: {msg}", path.display(), if tensor.is_empty() { String::new() } else { format!(", tensor `{tensor}`") })]
    Weights {
        path: std::path::PathBuf,
        tensor: String,
        msg: String,
    },

    /// A file-system operation failed.
    #[error("{}: cannot {op}: {source}", path.display())]
    Io {
        path: std::path::PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },

    /// A runtime input that does not fit the layer (token count, sequence offsets).
    #[error("{context}: invalid input: {msg}")]
    Input { context: String, msg: String },
}

impl Error {
    /// Shorthand for [`Error::Config`].
    pub fn config(what: &'static str, msg: impl Into<String>) -> Self {
        Error::Config {
            what,
            msg: msg.into(),
        }
    }

    /// Shorthand for [`Error::Weights`].
    pub fn weights(path: &std::path::Path, tensor: &str, msg: impl Into<String>) -> Self {
        Error::Weights {
            path: path.to_path_buf(),
            tensor: tensor.to_string(),
            msg: msg.into(),
        }
    }

    /// Shorthand for [`Error::Io`].
    pub fn io(path: &std::path::Path, op: &'static str, source: std::io::Error) -> Self {
        Error::Io {
            path: path.to_path_buf(),
            op,
            source,
        }
    }

    /// Shorthand for [`Error::Input`].
    pub fn input(context: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Input {
            context: context.into(),
            msg: msg.into(),
        }
    }

    /// Refuses a model size no real model has: the largest of each key's checked
    /// `(key, value, largest)`, so a typo (an extra digit, a wrapped negative) fails here
    /// naming the key instead of as an allocation abort, a wrapped shape or an hours-long
    /// search. The limits are orders of magnitude above today's largest models.
    pub fn check_sizes(what: &'static str, sizes: &[(&str, usize, usize)]) -> Result<()> {
        for &(key, v, largest) in sizes {
            if v > largest {
                return Err(Error::config(
                    what,
                    format!(
                        "`{key}` = {v} is larger than any model's ({largest} at most): a typo?"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The largest layer count a config may ask (today's largest models have ~130).
pub const MAX_LAYERS: usize = 1 << 12;
/// The largest hidden, head or channel size (today's largest: ~25,000).
pub const MAX_WIDTH: usize = 1 << 17;
/// The largest MLP width (today's largest: ~100,000).
pub const MAX_FFN: usize = 1 << 20;
/// The largest head count.
pub const MAX_HEADS: usize = 1 << 12;
/// The largest vocabulary or position table (today's largest: ~260,000 tokens, a few
/// million positions).
pub const MAX_TABLE: usize = 1 << 24;

/// Adds a layer/step context to kernel and comm errors. The context string is only
/// built when there is an error.
pub trait Context<T> {
    /// `layer` is the layer's name (parameter prefix), `step` what it was doing.
    fn ctx(self, layer: &str, step: &str) -> Result<T>;
}

fn join(layer: &str, step: &str) -> String {
    if layer.is_empty() {
        step.to_string()
    } else {
        format!("{layer}: {step}")
    }
}

impl<T> Context<T> for std::result::Result<T, braid_kernels::Error> {
    fn ctx(self, layer: &str, step: &str) -> Result<T> {
        self.map_err(|source| Error::Kernel {
            context: join(layer, step),
            source,
        })
    }
}

impl<T> Context<T> for std::result::Result<T, braid_comm::CommError> {
    fn ctx(self, layer: &str, step: &str) -> Result<T> {
        self.map_err(|source| Error::Comm {
            context: join(layer, step),
            source,
        })
    }
}

impl<T> Context<T> for Result<T> {
    /// Prefixes the context of an nn error (a comm region's, say) with the layer's.
    fn ctx(self, layer: &str, step: &str) -> Result<T> {
        self.map_err(|e| match e {
            Error::Kernel { context, source } => Error::Kernel {
                context: join(layer, &format!("{step}: {context}")),
                source,
            },
            Error::Comm { context, source } => Error::Comm {
                context: join(layer, &format!("{step}: {context}")),
                source,
            },
            Error::Input { context, msg } => Error::Input {
                context: join(layer, &format!("{step}: {context}")),
                msg,
            },
            other @ (Error::Config { .. } | Error::Weights { .. } | Error::Io { .. }) => other,
        })
    }
}
