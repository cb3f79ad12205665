//! The router's watch on a run's etcd registry (`cargo xtask demo --discovery etcd`). See
//! `xtask::watch`.

fn main() -> std::process::ExitCode {
    xtask::watch::main()
}
