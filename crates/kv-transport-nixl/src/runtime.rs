//! Finding and loading the NIXL runtime.
//!
//! nixl-sys, built with `stub-api`, resolves NIXL's C API with `dlopen("libnixl_capi.so")` on
//! first use. kvflow loads that library itself, by absolute path and with `RTLD_GLOBAL`, before
//! any NIXL call, so glibc resolves nixl-sys's later `dlopen` by soname to the library already
//! loaded. NIXL finds its plugins in the `plugins/` folder beside `libnixl.so` (it asks `dladdr`
//! where it was loaded from) unless `NIXL_PLUGIN_DIR` says otherwise. The runtime is the
//! `nixl-cu12` wheel that `cargo xtask setup` unpacks into `.nixl/` (and prints the folder of);
//! kvflow finds it where [`prepare`] is told, else where `KVFLOW_NIXL_DIR` says. No path is
//! baked in at build time.
//!
//! Nothing here sets an environment variable: setting one races with any thread that reads the
//! environment, and an engine such as vLLM has threads running long before it makes its
//! connector. UCX's settings go to NIXL's backend as parameters instead
//! ([`crate::UCX_ENGINE_CONFIG`]). [`prepare`] may run at any time, once or more;
//! [`crate::NixlTransport::new`] fails with [`NixlError::RuntimeNotPrepared`] until it has.
#![allow(unsafe_code)] // dlopen: see the SAFETY notes.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::NixlError;

/// The environment variable that overrides where the runtime is.
pub const RUNTIME_ENV: &str = "KVFLOW_NIXL_DIR";

static LOADED: OnceLock<Result<PathBuf, NixlError>> = OnceLock::new();

/// The folder that would be used: `explicit`, else `$KVFLOW_NIXL_DIR`; none if neither says.
pub fn runtime_dir(explicit: Option<&Path>) -> Option<PathBuf> {
    explicit.map(Path::to_path_buf).or_else(|| std::env::var_os(RUNTIME_ENV).map(PathBuf::from))
}

/// Whether a runtime is present where [`runtime_dir`] looks.
pub fn runtime_present(explicit: Option<&Path>) -> bool {
    runtime_dir(explicit).is_some_and(|dir| dir.join("libnixl_capi.so").is_file())
}

/// Loads the runtime from `explicit`, else `$KVFLOW_NIXL_DIR`; once a load was tried, later
/// calls return its outcome.
pub fn prepare(explicit: Option<&Path>) -> Result<PathBuf, NixlError> {
    if let Some(loaded) = LOADED.get() {
        return loaded.clone();
    }
    let dir = runtime_dir(explicit).ok_or(NixlError::RuntimeNotConfigured)?;
    LOADED.get_or_init(|| load(&dir)).clone()
}

/// The outcome of [`prepare`]; [`NixlError::RuntimeNotPrepared`] if it has not run.
pub fn prepared() -> Result<PathBuf, NixlError> {
    LOADED.get().cloned().unwrap_or(Err(NixlError::RuntimeNotPrepared))
}

fn load(dir: &Path) -> Result<PathBuf, NixlError> {
    let lib = dir.join("libnixl_capi.so");
    if !lib.is_file() {
        return Err(NixlError::RuntimeMissing { path: lib });
    }
    let c_path = CString::new(lib.as_os_str().as_encoded_bytes())
        .map_err(|_| NixlError::RuntimeMissing { path: lib.clone() })?;
    // SAFETY: dlopen with a valid C string; the handle is kept for the life of the process.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let reason = unsafe {
            let err = libc::dlerror();
            if err.is_null() {
                "unknown error".to_owned()
            } else {
                std::ffi::CStr::from_ptr(err).to_string_lossy().into_owned()
            }
        };
        return Err(NixlError::RuntimeLoad { path: lib, reason });
    }
    tracing::debug!(path = %lib.display(), "NIXL runtime loaded");
    Ok(dir.to_path_buf())
}
