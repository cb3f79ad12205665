//! `cargo xtask vllm`: kvflow inside vLLM, on this machine's CPU. Provisions vLLM's CPU build
//! in an ignored virtualenv of the workspace (`.venv-vllm/`, every package pinned by
//! `crates/kvflow-py/vllm-lock.txt` and installed without the resolver; reused while the lock
//! file is unchanged), builds kvflow's wheel there with maturin, installs it, and runs the
//! Python tests (`crates/kvflow-py/tests`) with pytest. Beside it, `.venv-vllm033/` holds vLLM
//! 0.33's Python code over `.venv-vllm`'s packages (`crates/kvflow-py/vllm033-lock.txt`), for
//! the test that loads the connectors in the vLLM GPU users install.
//!
//! What it costs on a 2-core machine: the first provisioning downloads about 3.4 GB and takes
//! 2 to 4 minutes (a 6.5 GB virtualenv); the wheel builds in under a minute once the workspace
//! is built; the tests start each engine in a process of its own (about 15 s each: vLLM's
//! import, then its engine). vLLM 0.33's overlay downloads about 340 MB and installs in
//! seconds.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::provision;
use crate::workspace;

/// The virtualenv, relative to the workspace root (in `.gitignore`).
const VENV: &str = ".venv-vllm";
/// The pinned environment, relative to the workspace root.
const LOCK: &str = "crates/kvflow-py/vllm-lock.txt";
/// Inside the virtualenv: the lock it was provisioned from, once provisioning completed.
const STAMP: &str = "kvflow-vllm-lock.txt";
/// vLLM 0.33's overlay on [`VENV`], relative to the workspace root (in `.gitignore`).
const OVERLAY: &str = ".venv-vllm033";
/// What the overlay installs over [`VENV`]'s packages.
const OVERLAY_LOCK: &str = "crates/kvflow-py/vllm033-lock.txt";

/// Provisions the virtualenv, builds and installs the wheel, runs the Python tests.
pub fn run() -> Result<()> {
    let root = workspace::root();
    let venv = ensure_venv(&root)?;
    let python = venv.join("bin").join("python");
    let overlay = ensure_overlay(&root, &python)?.join("bin").join("python");
    let wheels = workspace::target_dir(&root).join("wheels");
    let _ = fs::remove_dir_all(&wheels);
    // The dev profile: the tests' engines move KV over NIXL, whose copies are UCX's, built
    // optimised; a release build would only add minutes to CI.
    let manifest = root.join("crates/kvflow-py/Cargo.toml");
    let maturin = [
        "-m",
        "maturin",
        "build",
        "--locked",
        "--profile",
        "dev",
        "--interpreter",
        &python.display().to_string(),
        "-m",
        &manifest.display().to_string(),
        "--out",
        &wheels.display().to_string(),
    ]
    .map(str::to_owned);
    run_python(&python, &maturin, &root, "building kvflow's wheel with maturin")?;
    let wheel = fs::read_dir(&wheels)
        .with_context(|| format!("maturin wrote no {}", wheels.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|path| path.extension().is_some_and(|ext| ext == "whl"))
        .with_context(|| format!("maturin wrote no wheel into {}", wheels.display()))?;
    let install = ["-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-cache-dir", "-q"]
        .map(str::to_owned)
        .into_iter()
        .chain([wheel.display().to_string()])
        .collect::<Vec<_>>();
    run_python(&python, &install, &root, "installing kvflow's wheel")?;
    // tiny-llama's writer, whose model transformers checks from outside (issue 33).
    workspace::cargo(&root, &["build", "--locked", "-p", "kv-model", "--example", "tiny_llama"])?;
    let tiny_llama = workspace::target_dir(&root).join("debug/examples/tiny_llama");
    let tests = root.join("crates/kvflow-py/tests");
    let pytest = ["-m", "pytest", "-q", "-p", "no:cacheprovider"].map(str::to_owned);
    let pytest = pytest.into_iter().chain([tests.display().to_string()]).collect::<Vec<_>>();
    // The wheel itself too: a test installs it into a fresh virtualenv; and vLLM 0.33's
    // Python, which finds this wheel through the overlay's path.
    let env = [
        ("KVFLOW_WHEEL", wheel.as_path()),
        ("KVFLOW_VLLM_033", overlay.as_path()),
        ("KVFLOW_TINY_LLAMA", tiny_llama.as_path()),
    ];
    run_python_with(&python, &pytest, &root, "kvflow's Python tests", &env)
}

/// Checks the tokens of the model demos' reports (`cargo xtask demo --model tiny-llama
/// --json-out`) with transformers in the virtualenv (provisioned by [`run`]): every generated
/// token, teacher-forced, is transformers' argmax or loses to it only by rounding, for the
/// model written to `model_dir` (`--save-model`).
pub fn check_model_tokens(model_dir: &Path, reports: &[PathBuf]) -> Result<()> {
    let root = workspace::root();
    let python = ensure_venv(&root)?.join("bin").join("python");
    let script = root.join("crates/kvflow-py/tests/check_tokens.py");
    let paths = [script.as_path(), model_dir].into_iter().chain(reports.iter().map(PathBuf::as_path));
    let args: Vec<String> = paths.map(|p| p.display().to_string()).collect();
    run_python(&python, &args, &root, "transformers' check of the model demos' tokens")
}

/// vLLM 0.33's overlay: a virtualenv that sees `base`'s packages (a `.pth` file) with the
/// overlay lock installed over them without their dependencies; rebuilt when either lock
/// changes.
fn ensure_overlay(root: &Path, base: &Path) -> Result<PathBuf> {
    let venv = root.join(OVERLAY);
    let lock_path = root.join(OVERLAY_LOCK);
    let lock = fs::read_to_string(&lock_path).with_context(|| format!("cannot read {}", lock_path.display()))?;
    let base_lock = fs::read_to_string(root.join(VENV).join(STAMP)).unwrap_or_default();
    let stamp = format!("{lock}\n{base_lock}");
    if fs::read_to_string(venv.join(STAMP)).is_ok_and(|s| s == stamp) {
        eprintln!("xtask: {OVERLAY} is provisioned from {OVERLAY_LOCK}; reusing it");
        return Ok(venv);
    }
    let _ = fs::remove_dir_all(&venv);
    create_venv(&venv)?;
    let python = venv.join("bin").join("python");
    let purelib = |python: &Path| -> Result<PathBuf> {
        let out = Command::new(python)
            .args(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
            .output()
            .with_context(|| format!("cannot start {}", python.display()))?;
        if !out.status.success() {
            bail!("{} cannot say where its packages are:\n{}", python.display(), provision::output_tail(&out));
        }
        Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    };
    let (base_site, site) = (purelib(base)?, purelib(&python)?);
    fs::write(site.join("kvflow_beside_vllm.pth"), format!("{}\n", base_site.display()))
        .with_context(|| format!("cannot write the .pth file into {}", site.display()))?;
    eprintln!("xtask: installing vLLM 0.33's Python code into {OVERLAY} over {VENV}'s packages (about 340 MB)");
    install_lock(&python, &lock_path, root, "installing vLLM 0.33")?;
    fs::write(venv.join(STAMP), stamp).with_context(|| format!("cannot write {OVERLAY}/{STAMP}"))?;
    Ok(venv)
}

/// The virtualenv, provisioned from the lock file unless it already was from this one.
fn ensure_venv(root: &Path) -> Result<PathBuf> {
    let venv = root.join(VENV);
    let lock_path = root.join(LOCK);
    let lock = fs::read_to_string(&lock_path).with_context(|| format!("cannot read {}", lock_path.display()))?;
    if fs::read_to_string(venv.join(STAMP)).is_ok_and(|stamp| stamp == lock) {
        eprintln!("xtask: {VENV} is provisioned from {LOCK}; reusing it");
        return Ok(venv);
    }
    let _ = fs::remove_dir_all(&venv);
    create_venv(&venv)?;
    eprintln!("xtask: installing vLLM's CPU build and its pinned environment into {VENV} (about 3.4 GB from PyPI)");
    let python = venv.join("bin").join("python");
    install_lock(&python, &lock_path, root, "installing the pinned environment")?;
    fs::write(venv.join(STAMP), lock).with_context(|| format!("cannot write {VENV}/{STAMP}"))?;
    Ok(venv)
}

/// Installs every package `lock` pins with the virtualenv's pip, without their dependencies
/// (pip's resolver never runs: see the lock files).
fn install_lock(python: &Path, lock: &Path, root: &Path, what: &str) -> Result<()> {
    let install = ["-m", "pip", "install", "--no-deps", "--no-cache-dir", "-q", "--disable-pip-version-check", "-r"]
        .map(str::to_owned)
        .into_iter()
        .chain([lock.display().to_string()])
        .collect::<Vec<_>>();
    run_python(python, &install, root, what)
}

/// `python3 -m venv`; where Python lacks its venv module, Debian's python3-venv is installed
/// first (as root).
fn create_venv(venv: &Path) -> Result<()> {
    let make = || Command::new("python3").args(["-m", "venv"]).arg(venv).output();
    let output = make().context("cannot start python3: install Python 3.11 or later")?;
    if output.status.success() {
        return Ok(());
    }
    let how = "install Python's venv module (Debian/Ubuntu: `apt-get install python3-venv`)";
    if !provision::is_root() || kv_demo::find_in_path("apt-get").is_none() {
        bail!("`python3 -m venv` failed ({}):\n{}\n{how}", output.status, provision::output_tail(&output));
    }
    eprintln!("xtask: `python3 -m venv` failed; installing Debian's python3-venv");
    for args in [&["update"][..], &["install", "-y", "--no-install-recommends", "python3-venv"]] {
        let apt = Command::new("apt-get").args(args).env("DEBIAN_FRONTEND", "noninteractive").output()?;
        if !apt.status.success() {
            bail!("`apt-get {}` failed ({}):\n{}\n{how}", args.join(" "), apt.status, provision::output_tail(&apt));
        }
    }
    let _ = fs::remove_dir_all(venv);
    let output = make()?;
    if !output.status.success() {
        bail!("`python3 -m venv` failed again ({}):\n{}\n{how}", output.status, provision::output_tail(&output));
    }
    Ok(())
}

/// Runs the virtualenv's `python args...` in `root`, its output shown; `what` names it in the
/// error.
fn run_python(python: &Path, args: &[String], root: &Path, what: &str) -> Result<()> {
    run_python_with(python, args, root, what, &[])
}

/// [`run_python`] with more environment variables.
fn run_python_with(python: &Path, args: &[String], root: &Path, what: &str, env: &[(&str, &Path)]) -> Result<()> {
    eprintln!("xtask: {} {}", python.display(), args.join(" "));
    let status = Command::new(python)
        .args(args)
        .current_dir(root)
        // The tests' engines find nothing online and need nothing: the model is local.
        .env("HF_HUB_OFFLINE", "1")
        .envs(env.iter().copied())
        .status()
        .with_context(|| format!("cannot start {}", python.display()))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}
