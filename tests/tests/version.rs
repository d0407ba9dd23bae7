//! `dataplane version` names the source commit the binary was built from.
//! Not in the VM suite: the guests have neither git nor the checkout.

use std::process::Command;

use dataplane_tests::agent_binary;

#[test]
fn version_names_the_commit_the_binary_was_built_from() -> anyhow::Result<()> {
    // The checkout the binary under test was built from: this package's
    // workspace (`cargo xtask test` builds it before running the tests).
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or_else(|| anyhow::anyhow!("the tests crate has no parent directory"))?;
    let git = |args: &[&str]| -> anyhow::Result<String> {
        let out = Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()?;
        anyhow::ensure!(out.status.success(), "git {args:?} failed");
        Ok(String::from_utf8(out.stdout)?.trim().to_owned())
    };
    let head = git(&["rev-parse", "HEAD"])?;
    let json = Command::new(agent_binary()?)
        .args(["version", "--json"])
        .output()?;
    assert!(json.status.success());
    let parsed: serde_json::Value = serde_json::from_slice(&json.stdout)?;
    assert_eq!(
        parsed["commit"].as_str(),
        Some(head.as_str()),
        "the binary names HEAD of its checkout (rebuild it after a commit: `cargo xtask build`)"
    );
    assert!(parsed["dirty"].is_boolean(), "{parsed}");
    if git(&["status", "--porcelain", "--untracked-files=no"])?.is_empty() {
        assert_eq!(
            parsed["dirty"].as_bool(),
            Some(false),
            "a clean checkout built a binary that says it had changes"
        );
    }
    let text = Command::new(agent_binary()?).arg("version").output()?;
    let text = String::from_utf8(text.stdout)?;
    assert!(
        text.lines()
            .any(|l| l.starts_with(&format!("commit: {head}"))),
        "{text}"
    );
    Ok(())
}
