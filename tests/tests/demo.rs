//! The demo (`cargo xtask demo`) runs in CI: it exits non-zero if any flow
//! does not behave as its report says, and leaves nothing behind.

use std::time::Duration;

use dataplane_tests::{process::target_binary, spawn_in};

#[test]
fn demo_flows_behave_as_reported() -> anyhow::Result<()> {
    let demo = target_binary("dp-demo", "cargo builds it with this package's tests")?;
    let out =
        spawn_in(std::process::Command::new(demo), None, None)?.wait(Duration::from_secs(120))?;
    assert_eq!(out.code, Some(0), "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("every flow behaved as reported"),
        "{}",
        out.stdout
    );
    assert_eq!(
        out.stdout.matches("as expected").count(),
        5,
        "{}",
        out.stdout
    );
    Ok(())
}
