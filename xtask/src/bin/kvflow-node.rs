//! An engine process of `cargo xtask demo` and the end-to-end bench: P or D, as its JSON
//! argument says. See `xtask::node`.

fn main() -> std::process::ExitCode {
    xtask::node::main()
}
