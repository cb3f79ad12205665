//! Finding and loading the NIXL runtime.
//!
//! nixl-sys, built with `stub-api`, resolves NIXL's C API with `dlopen("libnixl_capi.so")` on
//! first use. kvflow loads that library itself, by absolute path and with `RTLD_GLOBAL`, before
//! any NIXL call, so glibc resolves nixl-sys's later `dlopen` by soname to the library already
//! loaded; and it points `NIXL_PLUGIN_DIR` at the runtime's `plugins/` folder before the first
//! agent. The runtime is the `nixl-cu12` wheel that `cargo xtask setup` unpacks into `.nixl/`
//! (and prints the folder of); kvflow finds it where [`prepare`] is told, else where
//! `KVFLOW_NIXL_DIR` says. No path is baked in at build time.
//!
//! Those environment variables are process-wide, and setting one races with any other thread
//! that reads the environment, so the library never sets them behind the engine's back: the
//! engine calls [`prepare`] once at startup, before it starts threads, and
//! [`crate::NixlTransport::new`] fails with [`NixlError::RuntimeNotPrepared`] until it has.
//!
//! Where a CUDA driver is installed, it also turns on UCX's zero-copy GET over CUDA IPC
//! ([`UCX_CUDA_IPC_GET_ENV`]) unless the environment already sets it: under UCX's default, `auto`, it is off on platforms that UCX
//! judges slower for GET than for PUT (an H100 with no NVLink peer among them), and a read of
//! VRAM from another process then falls back to UCX's software emulation over TCP. Seen on an
//! H100: a 256 MiB VRAM-to-VRAM NIXL read at 0.44 GB/s with `auto`, where a write of the same
//! bytes took the CUDA IPC path at 739 GB/s. Reads are kvflow's pull path, so it wants GET.
#![allow(unsafe_code)] // dlopen and setenv: see the SAFETY notes.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::NixlError;

/// The environment variable that overrides where the runtime is.
pub const RUNTIME_ENV: &str = "KVFLOW_NIXL_DIR";

/// UCX's switch for zero-copy GET over CUDA IPC, set to `y` before the first agent where a CUDA
/// driver is installed, unless the environment sets it (see the module docs). Without a driver
/// UCX loads no CUDA transport and would warn that the variable is unused.
pub const UCX_CUDA_IPC_GET_ENV: &str = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY";

static LOADED: OnceLock<Result<PathBuf, NixlError>> = OnceLock::new();

/// The folder that would be used: `explicit`, else `$KVFLOW_NIXL_DIR`; none if neither says.
pub fn runtime_dir(explicit: Option<&Path>) -> Option<PathBuf> {
    explicit.map(Path::to_path_buf).or_else(|| std::env::var_os(RUNTIME_ENV).map(PathBuf::from))
}

/// Whether a runtime is present where [`runtime_dir`] looks.
pub fn runtime_present(explicit: Option<&Path>) -> bool {
    runtime_dir(explicit).is_some_and(|dir| dir.join("libnixl_capi.so").is_file())
}

/// Loads the runtime from `explicit`, else `$KVFLOW_NIXL_DIR`, and sets the environment NIXL
/// and UCX read when an agent is made (see the module docs), unless the environment already
/// sets it. Call it once at startup, before the engine starts threads; once a load was tried,
/// later calls return its outcome.
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
    let plugins = dir.join("plugins");
    // Once, before this process creates any NIXL agent (which reads them); what the
    // environment already says wins.
    if std::env::var_os("NIXL_PLUGIN_DIR").is_none() {
        std::env::set_var("NIXL_PLUGIN_DIR", &plugins);
    }
    if std::env::var_os(UCX_CUDA_IPC_GET_ENV).is_none() && cuda_driver_installed() {
        std::env::set_var(UCX_CUDA_IPC_GET_ENV, "y");
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
    tracing::debug!(path = %lib.display(), plugins = %plugins.display(), "NIXL runtime loaded");
    Ok(dir.to_path_buf())
}

/// Whether the CUDA driver library loads, as UCX's CUDA transports need it to.
fn cuda_driver_installed() -> bool {
    // SAFETY: dlopen with a valid C string; a handle it returns is closed again at once.
    unsafe {
        let handle = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            return false;
        }
        libc::dlclose(handle);
    }
    true
}
