//! `cargo xtask install --prefix DIR`: the installed layout, `1bit plugins` from it listing
//! every route, and the `llama-server` link that Lemonade runs, which never shadows the real
//! llama-server serve starts.

use std::path::Path;
use std::process::Command;

use onebit_tests::*;

fn install(prefix: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(root)
        .args([
            "run", "-q", "-p", "xtask", "--", "install", "--debug", "--prefix",
        ])
        .arg(prefix)
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn an_installed_1bit_lists_every_route_and_its_llama_server_link_serves_lemonades_argv() {
    let prefix = temp_dir("install");
    install(&prefix);
    let bin = prefix.join("bin");
    assert_eq!(
        std::fs::read_link(bin.join("llama-server")).unwrap(),
        Path::new("1bit")
    );
    assert!(prefix.join("lib/1bit/llama-server/llama-server").is_file());
    // The hybrid route's prefill provider, for --prefill-provider: it runs and says what it
    // lacks.
    let provider = Command::new(bin.join("1bit-prefill-llama"))
        .output()
        .unwrap();
    assert_eq!(provider.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&provider.stderr).trim(),
        "1bit-prefill-llama: --tokens IDS is missing"
    );

    // Only the installed routes: no --plugin-dir, no ONEBIT_PLUGIN_PATH.
    let out = Command::new(bin.join("1bit"))
        .arg("plugins")
        .env_remove("ONEBIT_PLUGIN_PATH")
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&out.stdout);
    for route in ["cpu", "hrx", "hybrid", "ds4", "npu"] {
        let line = listing
            .lines()
            .find(|l| l.starts_with(&format!("{route} ")))
            .unwrap_or_else(|| panic!("{route} missing:\n{listing}"));
        assert!(line.contains(&prefix.display().to_string()), "{line}");
        // Each route is a package, made and installed as a vendor's is.
        assert!(
            line.contains(&format!(
                "lib/1bit/plugins/{route}  package 0.1.0 by 1bit serve (MIT)"
            )),
            "{line}"
        );
        assert!(line.contains("loaded"), "{line}");
    }
    assert!(!listing.contains("not loaded"), "{listing}");

    // The fake backend is installed with 1bit: the installed check runs the cpu route's
    // backend as it, through serve, on any machine.
    let smol = installed_model("SmolLM2-135M-Instruct-Q4_1.gguf");
    let out = Command::new(bin.join("1bit"))
        .args(["plugins", "check"])
        .arg(prefix.join("lib/1bit/plugins/cpu"))
        .args(["-m", smol.to_str().unwrap()])
        .env_remove("ONEBIT_FAKE_BACKEND")
        .env_remove("ONEBIT_PLUGIN_PATH")
        .output()
        .unwrap();
    let checked = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{checked}");
    let fake = bin.join("1bit-fake-backend");
    assert!(
        checked.contains(&format!(
            "ok   backend start: started as {} ",
            fake.display()
        )),
        "{checked}"
    );

    // With the prefix's bin first on PATH and no cache, the link still starts the real
    // llama-server installed beside it, not itself.
    let dir = temp_dir("install-model");
    let model = dummy_model(&dir, "m.gguf");
    let port = free_port();
    let mut link = Command::new(bin.join("llama-server"));
    link.args(["-m", smol.to_str().unwrap(), "--ctx-size", "4096", "--port"])
        .arg(port.to_string())
        .args([
            "--jinja",
            "--metrics",
            "--reasoning-format",
            "auto",
            "--no-ui",
            "--temp",
            "0.6",
        ])
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env("ONEBIT_CACHE_DIR", temp_dir("install-cache"))
        .env("ONEBIT_STATE_DIR", temp_dir("state"))
        .env("ONEBIT_HRX_PRESENT", "0")
        .env_remove("ONEBIT_LLAMA_SERVER")
        .env_remove("ONEBIT_PLUGIN_PATH");
    let serve = Serve::spawn(link, port);
    assert!(
        serve.wait_health(200, std::time::Duration::from_secs(120)),
        "{}",
        serve.output()
    );
    let (status, body) = post(
        &serve.url("/v1/chat/completions"),
        r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#,
    );
    assert_eq!(status, 200, "{body}");
    drop(serve);

    let out = Command::new(bin.join("1bit"))
        .args([
            "serve",
            "-m",
            model.to_str().unwrap(),
            "--device",
            "cpu",
            "--print-backend",
        ])
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env("ONEBIT_CACHE_DIR", temp_dir("install-cache"))
        .env_remove("ONEBIT_LLAMA_SERVER")
        .env_remove("ONEBIT_PLUGIN_PATH")
        .output()
        .unwrap();
    let line = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(line.trim())
        .unwrap_or_else(|_| panic!("{line}\n{}", String::from_utf8_lossy(&out.stderr)));
    let real = prefix.join("lib/1bit/llama-server/llama-server");
    assert_eq!(v["argv"][0], real.to_str().unwrap(), "{v}");
}
