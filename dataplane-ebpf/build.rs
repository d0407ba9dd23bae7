//! The kernel crate links with `bpf-linker`, a binary cargo cannot track as a
//! dependency. Re-running when that binary changes keeps a rebuilt linker
//! from being silently ignored; a linker that is missing is a clear error.

use which::which;

fn main() {
    match which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        Err(err) => {
            println!("cargo:warning=bpf-linker not found on PATH ({err}); run `cargo xtask setup`")
        }
    }
}
