//! Builds the stand-in for the vendor's closed kernels, `libacme_kernels.so.1`, from
//! `kernels/acme_kernels.c`, into the cargo profile folder (`target/<profile>/`), beside the
//! route library `libonebit_route_acme.so`: the loose layout `plan` finds through the route's
//! folder, and the file `1bit plugins package --carry` puts in the package.
//!
//! The route is not linked against the library: it loads it at run time (src/kernels.rs). A real
//! vendor who ships a prebuilt binary drops this script and copies the binary there instead.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The kernels library's file name, which is also its SONAME.
const KERNELS: &str = "libacme_kernels.so.1";

fn main() {
    for file in ["kernels/acme_kernels.c", "kernels/acme_kernels.h"] {
        println!("cargo:rerun-if-changed={file}");
    }
    println!("cargo:rerun-if-env-changed=CC");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let output = profile_dir(&out_dir).join(KERNELS);
    compile(&output);
    // For the crate's own tests, which load the library they test against from here.
    println!("cargo:rustc-env=ACME_KERNELS_BUILT={}", output.display());
}

/// `target/<profile>/`: OUT_DIR is `target/<profile>/build/<package>-<hash>/out`.
fn profile_dir(out_dir: &Path) -> PathBuf {
    out_dir
        .ancestors()
        .nth(3)
        .unwrap_or_else(|| {
            panic!(
                "OUT_DIR {} is not under target/<profile>/build/<package>-<hash>/out",
                out_dir.display()
            )
        })
        .to_path_buf()
}

/// Compile the kernels into `output` with the system's C compiler (`$CC`, else `cc`).
fn compile(output: &Path) {
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let mut command = Command::new(&compiler);
    command
        .args([
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
            "-Wall",
            "-Wextra",
            "-O2",
        ])
        .arg(format!("-Wl,-soname,{KERNELS}"))
        .arg("-o")
        .arg(output)
        .arg("kernels/acme_kernels.c");
    // The repository's clippy.toml bans Command::status for serve's own code (processes must
    // die with serve); a build script's compiler run is no process of serve's.
    #[allow(clippy::disallowed_methods)]
    let status = command.status();
    match status {
        Ok(status) if status.success() => {}
        Ok(status) => panic!(
            "{compiler} failed ({status}) building {}: see its messages above",
            output.display()
        ),
        Err(e) => panic!(
            "cannot run the C compiler {compiler} to build {}: {e}; install one (cc) or set CC",
            output.display()
        ),
    }
}
