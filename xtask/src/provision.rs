//! `cargo xtask setup`: provisions what nixl-sys needs to build and to run, on a fresh machine.
//!
//! Two things are needed (see DESIGN.md, "Transport"):
//!
//! - **libclang**, for the bindgen run in nixl-sys's build script, with clang's resource
//!   headers (`stddef.h`, `stdbool.h`, ...). An existing `LIBCLANG_PATH` is honoured; else the
//!   usual system folders are searched; else, as root with `apt-get`, Debian's `libclang-dev`
//!   is installed (its dependencies bring `libclang-common-*-dev`, the resource headers).
//! - **the NIXL runtime**, from the `nixl-cu12` 1.5.1 wheel on PyPI: fetched with
//!   `python3 -m pip download` (or taken from `KVFLOW_NIXL_WHEEL`), checked against its
//!   SHA-256, and unpacked into `<workspace>/.nixl/nixl_cu12-1.5.1/`. The runtime folder, which
//!   holds `libnixl_capi.so`, is then always [`RUNTIME_SUBDIR`] under the workspace root.
//!
//! [`ensure`] is idempotent: once a marker file says the unpack completed, it only checks a
//! few paths and returns in milliseconds.

use std::ffi::OsStr;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::ci::workspace_root;

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

/// `cargo xtask setup`: provisions libclang and the NIXL runtime, then prints where they are.
pub fn run(args: &[String]) -> Result<()> {
    if let Some(arg) = args.first() {
        bail!("cargo xtask setup takes no arguments, got {arg:?}");
    }
    let start = Instant::now();
    let env = ensure()?;
    println!("libclang        {}", env.libclang_dir.display());
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

/// Makes sure libclang and the NIXL runtime are there, fetching or installing what is missing.
pub fn ensure() -> Result<NixlEnv> {
    let root = workspace_root();
    let libclang_dir = ensure_libclang()?;
    ensure_runtime(&root)?;
    Ok(NixlEnv {
        libclang_dir,
        runtime_dir: root.join(RUNTIME_SUBDIR),
        plugin_dir: root.join(PLUGIN_SUBDIR),
        ucx_lib_dir: root.join(UCX_LIB_SUBDIR),
    })
}

// ---------------------------------------------------------------------------------------------
// libclang

/// Finds libclang (honouring `LIBCLANG_PATH`), installing Debian's `libclang-dev` if needed.
fn ensure_libclang() -> Result<PathBuf> {
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
            return Ok(dir);
        }
        eprintln!("xtask: {LIBCLANG_ENV}={} holds no libclang.so*; looking in the usual places", dir.display());
    }
    if let Some(dir) = find_system_libclang() {
        return Ok(dir);
    }
    install_libclang()?;
    match find_system_libclang() {
        Some(dir) => Ok(dir),
        None => bail!(
            "apt-get installed libclang-dev, but no libclang.so* with clang's resource headers \
             (clang/*/include/stddef.h) turned up under /usr/lib/llvm-*/lib or /usr/lib/*-linux-gnu; \
             set {LIBCLANG_ENV} to the folder holding libclang.so"
        ),
    }
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

/// Installs Debian's `libclang-dev` with apt-get, as root; otherwise says what to do.
fn install_libclang() -> Result<()> {
    let how = format!(
        "install it (Debian/Ubuntu, as root: `apt-get update && apt-get install -y --no-install-recommends \
         libclang-dev`), or set {LIBCLANG_ENV} to a folder holding libclang.so whose clang resource headers \
         are installed"
    );
    if find_in_path("apt-get").is_none() {
        bail!("libclang (needed by nixl-sys's bindgen build) was not found and there is no apt-get here; {how}");
    }
    if !is_root() {
        bail!("libclang (needed by nixl-sys's bindgen build) was not found and installing it needs root; {how}");
    }
    eprintln!(
        "xtask: libclang not found; installing Debian's libclang-dev \
         (apt-get update && apt-get install -y --no-install-recommends libclang-dev)"
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
    apt(&["install", "-y", "-qq", "--no-install-recommends", "libclang-dev"])?;
    Ok(())
}

/// Whether this process runs as root (effective uid 0), read from `/proc/self/status`.
fn is_root() -> bool {
    let Ok(status) = fs::read_to_string("/proc/self/status") else { return false };
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|uids| uids.split_whitespace().nth(1))
        .is_some_and(|euid| euid == "0")
}

/// `name` as found on `PATH`.
fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|candidate| candidate.is_file())
}

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
fn output_tail(output: &Output) -> String {
    let text = format!("{}{}", String::from_utf8_lossy(&output.stderr), String::from_utf8_lossy(&output.stdout));
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

// ---------------------------------------------------------------------------------------------
// SHA-256 (FIPS 180-4), small enough to keep here rather than add a dependency.

const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
    0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
    0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
    0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
    0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
    0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
    0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
];

/// A streaming SHA-256.
struct Sha256 {
    state: [u32; 8],
    block: [u8; 64],
    block_len: usize,
    total_len: u64,
}

impl Sha256 {
    fn new() -> Self {
        Self {
            state: [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19],
            block: [0; 64],
            block_len: 0,
            total_len: 0,
        }
    }

    fn update(&mut self, mut data: &[u8]) {
        self.total_len = self.total_len.wrapping_add(data.len() as u64);
        if self.block_len > 0 {
            let take = (64 - self.block_len).min(data.len());
            self.block[self.block_len..self.block_len + take].copy_from_slice(&data[..take]);
            self.block_len += take;
            data = &data[take..];
            if self.block_len < 64 {
                return;
            }
            let block = self.block;
            compress(&mut self.state, &block);
            self.block_len = 0;
        }
        let mut chunks = data.chunks_exact(64);
        for chunk in &mut chunks {
            let mut block = [0u8; 64];
            block.copy_from_slice(chunk);
            compress(&mut self.state, &block);
        }
        let rest = chunks.remainder();
        self.block[..rest.len()].copy_from_slice(rest);
        self.block_len = rest.len();
    }

    fn finish(mut self) -> String {
        let bit_len = self.total_len.wrapping_mul(8);
        let mut pad = vec![0x80u8];
        let pad_zeros = (64 + 56 - (self.block_len + 1) % 64) % 64;
        pad.extend(std::iter::repeat_n(0u8, pad_zeros));
        pad.extend_from_slice(&bit_len.to_be_bytes());
        let total = self.total_len;
        self.update(&pad);
        self.total_len = total;
        self.state.iter().map(|word| format!("{word:08x}")).collect()
    }
}

/// One SHA-256 compression round over a 64-byte block.
fn compress(state: &mut [u32; 8], block: &[u8; 64]) {
    let mut w = [0u32; 64];
    for (i, word) in block.chunks_exact(4).enumerate() {
        w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
    }
    for i in 16..64 {
        let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
        let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16].wrapping_add(s0).wrapping_add(w[i - 7]).wrapping_add(s1);
    }
    let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut h] = *state;
    for i in 0..64 {
        let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
        let ch = (e & f) ^ (!e & g);
        let t1 = h.wrapping_add(s1).wrapping_add(ch).wrapping_add(K[i]).wrapping_add(w[i]);
        let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
        let maj = (a & b) ^ (a & c) ^ (b & c);
        let t2 = s0.wrapping_add(maj);
        h = g;
        g = f;
        f = e;
        e = d.wrapping_add(t1);
        d = c;
        c = b;
        b = a;
        a = t1.wrapping_add(t2);
    }
    for (s, v) in state.iter_mut().zip([a, b, c, d, e, f, g, h]) {
        *s = s.wrapping_add(v);
    }
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
    Ok(hasher.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha256(data: &[u8]) -> String {
        let mut hasher = Sha256::new();
        hasher.update(data);
        hasher.finish()
    }

    #[test]
    fn sha256_matches_fips_vectors() {
        assert_eq!(sha256(b""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert_eq!(sha256(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(
            sha256(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        assert_eq!(
            sha256(
                b"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu"
            ),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"
        );
    }

    #[test]
    fn sha256_is_independent_of_how_input_is_split() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 31 % 251) as u8).collect();
        let whole = sha256(&data);
        for split in [1, 7, 55, 56, 63, 64, 65, 128, 999] {
            let mut hasher = Sha256::new();
            for chunk in data.chunks(split) {
                hasher.update(chunk);
            }
            assert_eq!(hasher.finish(), whole, "split {split}");
        }
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
    fn stable_paths_nest() {
        assert!(RUNTIME_SUBDIR.starts_with(UNPACK_SUBDIR));
        assert!(PLUGIN_SUBDIR.starts_with(RUNTIME_SUBDIR));
        assert!(UCX_LIB_SUBDIR.starts_with(UNPACK_SUBDIR));
    }
}
