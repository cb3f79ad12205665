//! Why a scenario, or the list of scenario files, could not be had, and where in the file an
//! error is.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// Where in a scenario an error is. It displays as a prefix naming the file and the step:
/// `path: step 3: `, `step 3: `, or nothing.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct Location {
    /// The scenario file.
    pub file: Option<PathBuf>,
    /// The `[[step]]` table, counted from 1 in file order.
    pub step: Option<usize>,
    /// The key the error is about, dotted from the step (`until_s`, `expect.d_state.r1`) or,
    /// outside steps, from the top of the file (`cluster.mode`).
    pub key: Option<String>,
    /// The line and the column, both counted from 1, where the text the error is about starts.
    pub line_column: Option<(usize, usize)>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{}: ", file.display())?;
        }
        if let Some(step) = self.step {
            write!(f, "step {step}: ")?;
        }
        Ok(())
    }
}

/// Why a scenario, or the list of scenario files, could not be had.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// A file or folder could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: io::Error,
    },
    /// A folder given to [`scenario_files`](super::scenario_files) holds no `*.toml` file.
    #[error("no *.toml scenario file under {}", path.display())]
    NoScenarios {
        /// The folder.
        path: PathBuf,
    },
    /// The text is not valid TOML.
    #[error("{location}invalid TOML: {}{message}", match location.line_column {
        Some((line, column)) => format!("line {line}, column {column}: "),
        None => String::new(),
    })]
    Syntax {
        /// The file and the line and column, where known (no step: TOML syntax is checked
        /// before steps are told apart).
        location: Location,
        /// What the TOML parser said.
        message: String,
    },
    /// The text is TOML, but not a valid scenario.
    #[error("{location}{message}{}", match location.line_column {
        Some((line, column)) => format!(" (line {line}, column {column})"),
        None => String::new(),
    })]
    Invalid {
        /// The file, step, key, line and column, where there are.
        location: Location,
        /// What is wrong, naming the key and the value.
        message: String,
    },
}

impl ScenarioError {
    /// Where in the scenario the error is, for syntax and validity errors.
    pub fn location(&self) -> Option<&Location> {
        match self {
            ScenarioError::Syntax { location, .. } | ScenarioError::Invalid { location, .. } => Some(location),
            ScenarioError::Io { .. } | ScenarioError::NoScenarios { .. } => None,
        }
    }

    pub(super) fn in_file(mut self, path: &Path) -> Self {
        if let ScenarioError::Syntax { location, .. } | ScenarioError::Invalid { location, .. } = &mut self {
            location.file = Some(path.to_owned());
        }
        self
    }
}

/// An I/O error on `path`, as a [`ScenarioError`].
pub(super) fn io(path: &Path) -> impl Fn(io::Error) -> ScenarioError + '_ {
    move |source| ScenarioError::Io { path: path.to_owned(), source }
}
