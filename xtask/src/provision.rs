//! `cargo xtask setup`: provisions what the workspace needs to build and to run, on a fresh
//! machine.
//!
//! Five things are needed (see DESIGN.md, "Transport", "Deployment" and "Observability"):
//!
//! - **libclang**, for the bindgen run in nixl-sys's build script, with clang's resource
//!   headers (`stddef.h`, `stdbool.h`, ...). An existing `LIBCLANG_PATH` is honoured; else the
//!   usual system folders are searched; else Debian's `libclang-dev` is installed (its
//!   dependencies bring `libclang-common-*-dev`, the resource headers).
//! - **protoc**, for the protobuf compilation in etcd-client's build script (kv-discovery-etcd),
//!   with protobuf's well-known types (`google/protobuf/descriptor.proto`, ...) in the include
//!   folder next to it, where protoc looks by itself. An existing `PROTOC` (which prost-build
//!   reads) is honoured; else `protoc` on `PATH`; else Debian's `protobuf-compiler` and
//!   `libprotobuf-dev` are installed (the well-known types are in the latter, which
//!   `protobuf-compiler` only recommends).
//! - **etcd**, the server kv-discovery-etcd's tests and the demo start for themselves: `etcd` on
//!   `PATH`, else Debian's `etcd-server` is installed. Nothing here starts it.
//! - **promtool**, with which the demo checks every engine's metrics exposition
//!   (`promtool check metrics`): `promtool` on `PATH`, else Debian's `prometheus` is installed
//!   (about 19 MB; nothing here starts its server).
//! - **the NIXL runtime**, from the `nixl-cu12` 1.5.1 wheel on PyPI: fetched with
//!   `python3 -m pip download` (or taken from `KVFLOW_NIXL_WHEEL`), checked against its
//!   SHA-256, and unpacked into `<workspace>/.nixl/nixl_cu12-1.5.1/`. The runtime folder, which
//!   holds `libnixl_capi.so`, is then always [`RUNTIME_SUBDIR`] under the workspace root.
//!
//! The Debian packages for whatever of the first four is missing are installed together, with
//! one `apt-get update` and one `apt-get install`, as root; without root or apt-get, [`ensure`]
//! fails and says which packages to install.
//!
//! [`ensure`] is idempotent: once the tools are found and a marker file says the unpack
//! completed, it only checks a few paths and returns in milliseconds.

use std::ffi::OsStr;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

use crate::workspace;

/// The wheel that carries the NIXL runtime (nixl-sys 1.5.2 was seen working with it).
pub const WHEEL_NAME: &str = "nixl_cu12-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl";
/// The wheel's SHA-256, as PyPI lists it.
pub const WHEEL_SHA256: &str = "341d0dfa499f941c054614252f1d8047d1380e33f29c87707372ff5ec7d3779a";
/// Set to the path of an already downloaded wheel to skip the download.
pub const WHEEL_ENV: &str = "KVFLOW_NIXL_WHEEL";
/// Where the wheel is unpacked, relative to the workspace root.
pub const UNPACK_SUBDIR: &str = ".nixl/nixl_cu12-1.5.1";
/// The folder holding `libnixl_capi.so`, relative to the workspace root. Stable: the transport
/// crate compiles it in as its default.
pub const RUNTIME_SUBDIR: &str = ".nixl/nixl_cu12-1.5.1/.nixl_cu12.mesonpy.libs";
/// NIXL's plugin folder (the UCX plugin among them), relative to the workspace root.
pub const PLUGIN_SUBDIR: &str = ".nixl/nixl_cu12-1.5.1/.nixl_cu12.mesonpy.libs/plugins";
/// UCX and the other bundled libraries, relative to the workspace root.
pub const UCX_LIB_SUBDIR: &str = ".nixl/nixl_cu12-1.5.1/nixl_cu12.libs";
/// Where `pip download` puts the wheel, relative to the workspace root.
const DOWNLOAD_SUBDIR: &str = ".nixl/download";
/// Written into the unpack folder once everything else succeeded.
const MARKER: &str = ".kvflow-provisioned";
/// The environment variable nixl-sys's build (clang-sys) reads to find libclang.
const LIBCLANG_ENV: &str = "LIBCLANG_PATH";
/// The environment variable etcd-client's build (prost-build) reads to find protoc.
const PROTOC_ENV: &str = "PROTOC";
/// The environment variable the transport crate reads to find the NIXL runtime folder.
pub const NIXL_DIR_ENV: &str = "KVFLOW_NIXL_DIR";

/// Where the provisioned pieces are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlEnv {
    /// The folder holding libclang (for bindgen, through `LIBCLANG_PATH`).
    pub libclang_dir: PathBuf,
    /// The folder holding `libnixl_capi.so`.
    pub runtime_dir: PathBuf,
    /// NIXL's plugin folder, `plugins/`, which holds the UCX plugin (`libplugin_UCX.so`).
    pub plugin_dir: PathBuf,
    /// The wheel's `nixl_cu12.libs/`, which holds UCX (`libucp`, `libucs`, ...).
    pub ucx_lib_dir: PathBuf,
    /// The protobuf compiler etcd-client's build runs (as found through `PROTOC` or on `PATH`).
    pub protoc: PathBuf,
    /// The etcd server the discovery tests and the demo start.
    pub etcd: PathBuf,
    /// The promtool the demo checks the engines' metrics with.
    pub promtool: PathBuf,
}

impl NixlEnv {
    /// The environment to give child cargo processes: `LIBCLANG_PATH` and `KVFLOW_NIXL_DIR`.
    pub fn envs(&self) -> Vec<(String, String)> {
        vec![
            (LIBCLANG_ENV.to_owned(), self.libclang_dir.display().to_string()),
            (NIXL_DIR_ENV.to_owned(), self.runtime_dir.display().to_string()),
        ]
    }
}

/// `cargo xtask setup`: provisions libclang, protoc, etcd, promtool and the NIXL runtime, then
/// prints where they are.
pub fn run() -> Result<()> {
    let start = Instant::now();
    let env = ensure()?;
    println!("libclang        {}", env.libclang_dir.display());
    println!("protoc          {}", env.protoc.display());
    println!("etcd            {}", env.etcd.display());
    println!("promtool        {}", env.promtool.display());
    println!("NIXL runtime    {}", env.runtime_dir.display());
    println!("NIXL plugins    {}", env.plugin_dir.display());
    println!("UCX libraries   {}", env.ucx_lib_dir.display());
    println!("environment for builds and tests:");
    for (key, value) in env.envs() {
        println!("  {key}={value}");
    }
    println!("ready in {:.2} s", start.elapsed().as_secs_f64());
    Ok(())
}

/// Makes sure libclang, protoc, etcd, promtool and the NIXL runtime are there, fetching or
/// installing what is missing.
pub fn ensure() -> Result<NixlEnv> {
    let root = workspace::root();
    let tools = ensure_tools()?;
    ensure_runtime(&root)?;
    Ok(NixlEnv {
        libclang_dir: tools.libclang_dir,
        runtime_dir: root.join(RUNTIME_SUBDIR),
        plugin_dir: root.join(PLUGIN_SUBDIR),
        ucx_lib_dir: root.join(UCX_LIB_SUBDIR),
        protoc: tools.protoc,
        etcd: tools.etcd,
        promtool: tools.promtool,
    })
}

// ---------------------------------------------------------------------------------------------
// System tools: libclang, protoc, etcd, promtool

/// Something the workspace needs from the system, and the Debian packages that provide it.
struct Need {
    /// What it is and who needs it, for messages.
    what: &'static str,
    /// The Debian packages to install when it is missing.
    packages: &'static [&'static str],
    /// How to provide it by other means than these packages.
    otherwise: &'static str,
}

static LIBCLANG: Need = Need {
    what: "libclang with clang's resource headers (for nixl-sys's bindgen build)",
    packages: &["libclang-dev"],
    otherwise: "set LIBCLANG_PATH to a folder holding libclang.so whose clang resource headers \
                (clang/*/include/stddef.h) are installed (searched: /usr/lib/llvm-*/lib, /usr/lib/*-linux-gnu, \
                /usr/lib64, /usr/lib)",
};

static PROTOC: Need = Need {
    what: "protoc with protobuf's well-known types, google/protobuf/*.proto (for etcd-client's build)",
    packages: &["protobuf-compiler", "libprotobuf-dev"],
    otherwise: "set PROTOC to a protoc whose include folder (next to it, or ../include) holds \
                google/protobuf/descriptor.proto",
};

static ETCD: Need = Need {
    what: "etcd (for kv-discovery-etcd's tests and the demo's discovery)",
    packages: &["etcd-server"],
    otherwise: "put an etcd 3.4 or later binary on PATH",
};

static PROMTOOL: Need = Need {
    what: "promtool (for the demo's check of the engines' metrics, `promtool check metrics`)",
    packages: &["prometheus"],
    otherwise: "put Prometheus's promtool binary on PATH",
};

/// The system tools, found.
struct Tools {
    libclang_dir: PathBuf,
    protoc: PathBuf,
    etcd: PathBuf,
    promtool: PathBuf,
}

/// Finds libclang, protoc, etcd and promtool, installing the Debian packages of those that are
/// missing in one apt-get run.
fn ensure_tools() -> Result<Tools> {
    let missing = match find_tools() {
        Ok(tools) => return Ok(tools),
        Err(missing) => missing,
    };
    apt_install(&missing)?;
    find_tools().or_else(|still| {
        bail!(
            "apt-get installed {}, but these are still not found: {}; {}",
            packages(&missing).join(" "),
            still.iter().map(|need| need.what).collect::<Vec<_>>().join("; "),
            still.iter().map(|need| need.otherwise).collect::<Vec<_>>().join("; ")
        )
    })
}

/// The system tools, or what is missing.
fn find_tools() -> Result<Tools, Vec<&'static Need>> {
    match (find_libclang(), find_protoc(), find_in_path("etcd"), find_in_path("promtool")) {
        (Some(libclang_dir), Some(protoc), Some(etcd), Some(promtool)) => {
            Ok(Tools { libclang_dir, protoc, etcd, promtool })
        }
        (libclang, protoc, etcd, promtool) => Err([
            (libclang.is_none(), &LIBCLANG),
            (protoc.is_none(), &PROTOC),
            (etcd.is_none(), &ETCD),
            (promtool.is_none(), &PROMTOOL),
        ]
        .into_iter()
        .filter_map(|(missing, need)| missing.then_some(need))
        .collect()),
    }
}

/// The Debian packages that provide `needs`, each once, in order.
fn packages(needs: &[&Need]) -> Vec<&'static str> {
    let mut packages: Vec<&'static str> = Vec::new();
    for package in needs.iter().flat_map(|need| need.packages.iter().copied()) {
        if !packages.contains(&package) {
            packages.push(package);
        }
    }
    packages
}

/// Installs the Debian packages of `missing` with one `apt-get update` and one
/// `apt-get install`, as root; without root or apt-get, fails saying what to install. Nothing
/// missing, nothing run.
fn apt_install(missing: &[&Need]) -> Result<()> {
    if missing.is_empty() {
        return Ok(());
    }
    let list = packages(missing).join(" ");
    let whats = missing.iter().map(|need| need.what).collect::<Vec<_>>().join("; ");
    let how = format!(
        "install them (Debian/Ubuntu, as root: `apt-get update && apt-get install -y --no-install-recommends \
         {list}`), or {}",
        missing.iter().map(|need| need.otherwise).collect::<Vec<_>>().join("; or ")
    );
    if find_in_path("apt-get").is_none() {
        bail!("not found: {whats}; there is no apt-get here to install {list}; {how}");
    }
    if !is_root() {
        bail!("not found: {whats}; installing {list} needs root; {how}");
    }
    eprintln!(
        "xtask: not found: {whats}; installing Debian's {list} \
         (apt-get update && apt-get install -y --no-install-recommends {list})"
    );
    let apt = |args: &[&str]| -> Result<()> {
        let output = Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .output()
            .context("cannot start apt-get")?;
        if !output.status.success() {
            bail!("`apt-get {}` failed ({}):\n{}\n{how}", args.join(" "), output.status, output_tail(&output));
        }
        Ok(())
    };
    apt(&["update", "-qq"])?;
    let mut install = vec!["install", "-y", "-qq", "--no-install-recommends"];
    install.extend(packages(missing));
    apt(&install)
}

/// protoc as prost-build will run it (`PROTOC`, else `protoc` on `PATH`), if protobuf's
/// well-known types are where it looks for them by itself.
fn find_protoc() -> Option<PathBuf> {
    let protoc = match std::env::var_os(PROTOC_ENV).filter(|v| !v.is_empty()) {
        Some(value) => {
            let path = PathBuf::from(&value);
            if !path.is_file() {
                eprintln!("xtask: {PROTOC_ENV}={} is not a file; looking for protoc on PATH", path.display());
                find_in_path("protoc")?
            } else {
                path
            }
        }
        None => find_in_path("protoc")?,
    };
    if has_well_known_types(&protoc) {
        return Some(protoc);
    }
    eprintln!(
        "xtask: {} has no protobuf well-known types (google/protobuf/descriptor.proto) in its include folder",
        protoc.display()
    );
    None
}

/// Whether `google/protobuf/descriptor.proto` is in one of the folders protoc searches by
/// itself: `include` next to the binary, or `../include` (Debian's `/usr/include`).
fn has_well_known_types(protoc: &Path) -> bool {
    let real = fs::canonicalize(protoc).unwrap_or_else(|_| protoc.to_path_buf());
    let dirs: Vec<PathBuf> =
        [protoc, real.as_path()].into_iter().filter_map(Path::parent).map(Path::to_path_buf).collect();
    dirs.iter()
        .flat_map(|dir| [dir.join("include"), dir.join("../include")])
        .any(|include| include.join("google/protobuf/descriptor.proto").is_file())
}

// ---------------------------------------------------------------------------------------------
// libclang

/// Finds libclang: through `LIBCLANG_PATH` if it holds one, else in the usual system folders.
fn find_libclang() -> Option<PathBuf> {
    if let Some(value) = std::env::var_os(LIBCLANG_ENV).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(&value);
        // clang-sys accepts a folder or the library file itself.
        let dir = if path.is_file() { path.parent().map(Path::to_path_buf).unwrap_or_default() } else { path };
        if let Some(lib) = libclang_in(&dir) {
            if !has_resource_headers(&lib) {
                eprintln!(
                    "xtask: note: no clang resource headers (clang/*/include/stddef.h) next to {}; if bindgen \
                     fails on stddef.h, unset {LIBCLANG_ENV} so that xtask installs libclang-dev",
                    lib.display()
                );
            }
            return Some(dir);
        }
        eprintln!("xtask: {LIBCLANG_ENV}={} holds no libclang.so*; looking in the usual places", dir.display());
    }
    find_system_libclang()
}

/// The folders searched for libclang, most preferred first: the newest `/usr/lib/llvm-N/lib`,
/// then the multiarch and plain library folders.
fn libclang_search_dirs() -> Vec<PathBuf> {
    let mut llvm: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            let version = name.to_str()?.strip_prefix("llvm-")?.parse::<u32>().ok()?;
            Some((version, entry.path().join("lib")))
        })
        .collect();
    llvm.sort_by_key(|(version, _)| std::cmp::Reverse(*version));
    let mut dirs: Vec<PathBuf> = llvm.into_iter().map(|(_, dir)| dir).collect();
    dirs.push(PathBuf::from(format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH)));
    dirs.push(PathBuf::from("/usr/lib64"));
    dirs.push(PathBuf::from("/usr/lib"));
    dirs
}

/// The first usual folder with a libclang whose resource headers are installed too.
fn find_system_libclang() -> Option<PathBuf> {
    libclang_search_dirs().into_iter().find(|dir| libclang_in(dir).is_some_and(|lib| has_resource_headers(&lib)))
}

/// Whether `name` is a libclang shared library as clang-sys looks for it (`libclang.so`,
/// `libclang.so.1`, `libclang-14.so.1`, ...), but not `libclang-cpp` (the C++ API library).
fn is_libclang_name(name: &str) -> bool {
    if name.starts_with("libclang-cpp") {
        return false;
    }
    name == "libclang.so"
        || name.starts_with("libclang.so.")
        || (name.starts_with("libclang-") && (name.ends_with(".so") || name.contains(".so.")))
}

/// A libclang shared library in `dir`, if there is one.
fn libclang_in(dir: &Path) -> Option<PathBuf> {
    let mut names: Vec<PathBuf> = fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|entry| entry.file_name().to_str().is_some_and(is_libclang_name))
        .map(|entry| entry.path())
        .collect();
    names.sort();
    names.into_iter().next()
}

/// Whether clang's resource headers (`clang/*/include/stddef.h`) sit where libclang looks for
/// them: next to the library as found, next to the library its symlinks resolve to, or one
/// folder up from that (Debian's `/usr/lib/clang/<version>`).
fn has_resource_headers(lib: &Path) -> bool {
    let found_dir = lib.parent().map(Path::to_path_buf);
    let real_dir = fs::canonicalize(lib).ok().and_then(|real| real.parent().map(Path::to_path_buf));
    let real_parent = real_dir.as_deref().and_then(Path::parent).map(Path::to_path_buf);
    [found_dir, real_dir, real_parent].into_iter().flatten().any(|dir| !resource_header_dirs(&dir).is_empty())
}

/// The `clang/<version>/include` folders under `lib_dir` that hold `stddef.h`.
fn resource_header_dirs(lib_dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(lib_dir.join("clang"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("include"))
        .filter(|include| include.join("stddef.h").is_file())
        .collect()
}

/// Whether this process runs as root (effective uid 0), read from `/proc/self/status`.
pub(crate) fn is_root() -> bool {
    let Ok(status) = fs::read_to_string("/proc/self/status") else { return false };
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|uids| uids.split_whitespace().nth(1))
        .is_some_and(|euid| euid == "0")
}

use kv_demo::find_in_path;

// ---------------------------------------------------------------------------------------------
// NIXL runtime

/// Makes sure the wheel is unpacked under `root`; a no-op when the marker says it already is.
fn ensure_runtime(root: &Path) -> Result<()> {
    let dest = root.join(UNPACK_SUBDIR);
    if is_complete(root, &dest) {
        return Ok(());
    }
    let wheel = obtain_wheel(root)?;
    let nixl = root.join(".nixl");
    fs::create_dir_all(&nixl).with_context(|| format!("cannot create {}", nixl.display()))?;
    remove_stale_partials(&nixl);
    let partial = nixl.join(format!("nixl_cu12-1.5.1.partial-{}", std::process::id()));
    remove_dir_if_exists(&partial)?;
    eprintln!("xtask: unpacking {} into {}", wheel.display(), dest.display());
    unzip(&wheel, &partial)?;
    check_layout(&partial)?;
    fs::write(partial.join(MARKER), format!("sha256 {WHEEL_SHA256}\n"))
        .with_context(|| format!("cannot write {}", partial.join(MARKER).display()))?;
    // An earlier run may have left an incomplete unpack (no marker): replace it.
    remove_dir_if_exists(&dest)?;
    if let Err(err) = fs::rename(&partial, &dest) {
        // Another xtask may have finished first; its result is as good as ours.
        let _ = fs::remove_dir_all(&partial);
        if !is_complete(root, &dest) {
            return Err(err).with_context(|| format!("cannot move {} to {}", partial.display(), dest.display()));
        }
    }
    if !is_complete(root, &dest) {
        bail!(
            "unpacked the NIXL wheel, but {} is still incomplete; delete {} and run again",
            dest.display(),
            dest.display()
        );
    }
    Ok(())
}

/// Whether a completed unpack of the right wheel is in place.
fn is_complete(root: &Path, dest: &Path) -> bool {
    let marker_ok = fs::read_to_string(dest.join(MARKER)).is_ok_and(|m| m.trim() == format!("sha256 {WHEEL_SHA256}"));
    marker_ok
        && root.join(RUNTIME_SUBDIR).join("libnixl_capi.so").is_file()
        && root.join(PLUGIN_SUBDIR).join("libplugin_UCX.so").is_file()
        && root.join(UCX_LIB_SUBDIR).is_dir()
}

/// Checks that an unpacked wheel has the runtime, the UCX plugin and the UCX libraries where
/// [`RUNTIME_SUBDIR`], [`PLUGIN_SUBDIR`] and [`UCX_LIB_SUBDIR`] say.
fn check_layout(unpacked: &Path) -> Result<()> {
    let base = Path::new(UNPACK_SUBDIR);
    let rel = |sub: &str| -> PathBuf {
        // The constants all start with UNPACK_SUBDIR; strip it to get paths inside the wheel.
        Path::new(sub).strip_prefix(base).map(Path::to_path_buf).unwrap_or_else(|_| PathBuf::from(sub))
    };
    let capi = unpacked.join(rel(RUNTIME_SUBDIR)).join("libnixl_capi.so");
    let ucx_plugin = unpacked.join(rel(PLUGIN_SUBDIR)).join("libplugin_UCX.so");
    let ucx_libs = unpacked.join(rel(UCX_LIB_SUBDIR));
    let has_ucp = fs::read_dir(&ucx_libs)
        .into_iter()
        .flatten()
        .flatten()
        .any(|entry| entry.file_name().to_str().is_some_and(|name| name.starts_with("libucp")));
    for (what, ok, path) in [
        ("libnixl_capi.so", capi.is_file(), &capi),
        ("the UCX plugin", ucx_plugin.is_file(), &ucx_plugin),
        ("UCX (libucp*)", has_ucp, &ucx_libs),
    ] {
        if !ok {
            bail!(
                "the NIXL wheel unpacked into {} has no {what} at {}; the wheel's layout changed, so update \
                 the paths in xtask/src/provision.rs",
                unpacked.display(),
                path.display()
            );
        }
    }
    Ok(())
}

/// The verified wheel: from `KVFLOW_NIXL_WHEEL`, from an earlier download, or downloaded now.
fn obtain_wheel(root: &Path) -> Result<PathBuf> {
    if let Some(given) = std::env::var_os(WHEEL_ENV).filter(|v| !v.is_empty()) {
        let wheel = PathBuf::from(given);
        if !wheel.is_file() {
            bail!("{WHEEL_ENV}={} is not a file; point it at {WHEEL_NAME}, or unset it to download", wheel.display());
        }
        verify_sha256(&wheel)?;
        return Ok(wheel);
    }
    let download = root.join(DOWNLOAD_SUBDIR);
    let wheel = download.join(WHEEL_NAME);
    if wheel.is_file() {
        if sha256_file(&wheel)? == WHEEL_SHA256 {
            return Ok(wheel);
        }
        eprintln!("xtask: {} does not match its SHA-256; downloading it again", wheel.display());
        fs::remove_file(&wheel).with_context(|| format!("cannot remove {}", wheel.display()))?;
    }
    fs::create_dir_all(&download).with_context(|| format!("cannot create {}", download.display()))?;
    pip_download(&download)?;
    if !wheel.is_file() {
        let found: Vec<String> = fs::read_dir(&download)
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .collect();
        bail!(
            "pip ran, but {} is not there (found: {}){}",
            wheel.display(),
            if found.is_empty() { "nothing".to_owned() } else { found.join(", ") },
            manual_wheel_help(&download)
        );
    }
    verify_sha256(&wheel)?;
    Ok(wheel)
}

/// Downloads the wheel into `download` with `python3 -m pip download`.
fn pip_download(download: &Path) -> Result<()> {
    eprintln!("xtask: downloading the NIXL runtime ({WHEEL_NAME}, about 70 MB) from PyPI with pip");
    let dir = download.to_str().with_context(|| format!("{} is not valid UTF-8", download.display()))?;
    let args = [
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.11",
        "--implementation",
        "cp",
        "--abi",
        "cp311",
        "--platform",
        "manylinux_2_28_x86_64",
        "--retries",
        "2",
        "--timeout",
        "60",
        "--dest",
        dir,
        "nixl-cu12==1.5.1",
    ];
    let output = match Command::new("python3").args(args).output() {
        Ok(output) => output,
        Err(err) => bail!("cannot start python3 to download the NIXL wheel ({err}){}", manual_wheel_help(download)),
    };
    if !output.status.success() {
        bail!(
            "`python3 -m pip download nixl-cu12==1.5.1` failed ({}):\n{}{}",
            output.status,
            output_tail(&output),
            manual_wheel_help(download)
        );
    }
    Ok(())
}

/// What to do when the wheel cannot be downloaded here.
fn manual_wheel_help(download: &Path) -> String {
    format!(
        "\n\nto provide the NIXL runtime by hand: on a machine that reaches PyPI, fetch {WHEEL_NAME} \
         (sha256 {WHEEL_SHA256}) from https://pypi.org/project/nixl-cu12/1.5.1/#files, or with \
         `pip download nixl-cu12==1.5.1 --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
         --abi cp311 --platform manylinux_2_28_x86_64`; then either put it at {} or set {WHEEL_ENV}=/path/to/{WHEEL_NAME}, \
         and run `cargo xtask setup` again",
        download.join(WHEEL_NAME).display()
    )
}

/// Fails unless the file's SHA-256 is [`WHEEL_SHA256`], naming both hashes.
fn verify_sha256(wheel: &Path) -> Result<()> {
    let actual = sha256_file(wheel)?;
    if actual != WHEEL_SHA256 {
        bail!(
            "{} has sha256 {actual}, but {WHEEL_NAME} must have sha256 {WHEEL_SHA256}; delete it (or fix {WHEEL_ENV}) \
             and run `cargo xtask setup` again",
            wheel.display()
        );
    }
    Ok(())
}

/// Unpacks `wheel` into `dest` with Python's zipfile module, or `unzip` where there is no python3.
fn unzip(wheel: &Path, dest: &Path) -> Result<()> {
    let python = Command::new("python3")
        .args([OsStr::new("-m"), "zipfile".as_ref(), "-e".as_ref()])
        .arg(wheel)
        .arg(dest)
        .output();
    let output = match python {
        Ok(output) => output,
        Err(python_err) => match Command::new("unzip").arg("-q").arg("-o").arg(wheel).arg("-d").arg(dest).output() {
            Ok(output) => output,
            Err(unzip_err) => bail!(
                "cannot unpack {}: neither python3 ({python_err}) nor unzip ({unzip_err}) could be started; \
                 install python3 or unzip",
                wheel.display()
            ),
        },
    };
    if !output.status.success() {
        let _ = fs::remove_dir_all(dest);
        bail!(
            "cannot unpack {} into {} ({}):\n{}\ncheck the free disk space and run `cargo xtask setup` again",
            wheel.display(),
            dest.display(),
            output.status,
            output_tail(&output)
        );
    }
    Ok(())
}

/// Removes `*.partial-<pid>` folders under `.nixl` whose process is gone (an interrupted run).
fn remove_stale_partials(nixl: &Path) {
    for entry in fs::read_dir(nixl).into_iter().flatten().flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.rsplit_once(".partial-")).map(|(_, pid)| pid.to_owned()) else {
            continue;
        };
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(&pid).exists() {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// Removes `dir` and everything in it, if it exists.
fn remove_dir_if_exists(dir: &Path) -> Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(err) => {
            Err(err).with_context(|| format!("cannot remove {}; remove it by hand and run again", dir.display()))
        }
    }
}

/// The last lines of a command's stderr and stdout, for error messages.
pub(crate) fn output_tail(output: &Output) -> String {
    let text = format!("{}{}", String::from_utf8_lossy(&output.stderr), String::from_utf8_lossy(&output.stdout));
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// The SHA-256 of a file, as lowercase hex.
fn sha256_file(path: &Path) -> Result<String> {
    let mut file = fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_file_hashes_every_byte_as_lowercase_hex() {
        let dir = std::env::temp_dir().join(format!("kvflow-sha-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        // Longer than the read buffer, so that several reads make one hash.
        let data: Vec<u8> = (0..(3 << 20) + 17u32).map(|i| (i * 31 % 251) as u8).collect();
        let (empty, big) = (dir.join("empty"), dir.join("big"));
        fs::write(&empty, b"").unwrap();
        fs::write(&big, &data).unwrap();
        assert_eq!(sha256_file(&empty).unwrap(), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert_eq!(sha256_file(&big).unwrap(), hex(&Sha256::digest(&data)));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn libclang_names() {
        for yes in ["libclang.so", "libclang.so.1", "libclang-14.so", "libclang-14.so.1", "libclang-14.0.6.so.14"] {
            assert!(is_libclang_name(yes), "{yes}");
        }
        for no in ["libclang-cpp.so.14", "libclang-cpp.so", "libclangBasic.a", "libclang.a", "libclang-14.a"] {
            assert!(!is_libclang_name(no), "{no}");
        }
    }

    #[test]
    fn missing_tools_name_each_debian_package_once() {
        assert_eq!(
            packages(&[&PROTOC, &LIBCLANG, &PROTOC, &ETCD, &PROMTOOL]),
            ["protobuf-compiler", "libprotobuf-dev", "libclang-dev", "etcd-server", "prometheus"]
        );
        assert!(packages(&[]).is_empty());
    }

    #[test]
    fn protoc_needs_the_well_known_types_where_it_looks_for_them() {
        let dir = std::env::temp_dir().join(format!("kvflow-protoc-test-{}", std::process::id()));
        let protoc = dir.join("bin/protoc");
        fs::create_dir_all(protoc.parent().unwrap()).unwrap();
        fs::write(&protoc, b"").unwrap();
        assert!(!has_well_known_types(&protoc), "no include folder yet");
        // Debian's layout: /usr/bin/protoc with /usr/include/google/protobuf.
        let types = dir.join("include/google/protobuf");
        fs::create_dir_all(&types).unwrap();
        assert!(!has_well_known_types(&protoc), "an include folder without descriptor.proto");
        fs::write(types.join("descriptor.proto"), b"").unwrap();
        assert!(has_well_known_types(&protoc));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn stable_paths_nest() {
        assert!(RUNTIME_SUBDIR.starts_with(UNPACK_SUBDIR));
        assert!(PLUGIN_SUBDIR.starts_with(RUNTIME_SUBDIR));
        assert!(UCX_LIB_SUBDIR.starts_with(UNPACK_SUBDIR));
    }
}
