//! The router's watch on a run's etcd registry (`cargo xtask demo --discovery etcd`). See
//! `kv_demo::watch`.

fn main() -> std::process::ExitCode {
    kv_demo::watch::main()
}
