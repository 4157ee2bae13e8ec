//! The README's dependency line names this crate's own ABI version, so a vendor copying it
//! builds against the ABI this checkout is.

#[test]
fn the_readmes_dependency_line_names_the_version_in_cargo_toml() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let manifest = std::fs::read_to_string(format!("{dir}/Cargo.toml")).unwrap();
    let version = manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("Cargo.toml has a version line");
    let major_minor: Vec<&str> = version.split('.').take(2).collect();
    let wanted = format!(
        "onebit-plugin-api = {{ path = \"../1bit/plugin-api\", version = \"{}\" }}",
        major_minor.join(".")
    );
    let readme = std::fs::read_to_string(format!("{dir}/README.md")).unwrap();
    let lines: Vec<&str> = readme
        .lines()
        .filter(|l| l.starts_with("onebit-plugin-api ="))
        .collect();
    assert_eq!(
        lines,
        [wanted.as_str()],
        "README.md's dependency line must name {version}'s minor"
    );
}
