//! The command line's own checks: clap's consistency and the value parsers.

use super::*;
use clap::CommandFactory;

#[test]
fn cli_is_consistent() {
    Cli::command().debug_assert();
}

#[test]
fn durations_parse() {
    assert!(parse_positive_duration("0s").is_err());
    assert_eq!(
        parse_positive_duration("2s"),
        Ok(std::time::Duration::from_secs(2))
    );
}

/// The command `argv` parses into.
fn command(argv: &[&str]) -> Command {
    match Cli::try_parse_from(argv) {
        Ok(cli) => cli.command,
        Err(e) => panic!("`{}` does not parse: {e}", argv.join(" ")),
    }
}

/// The flags that components no longer own reach them unchanged.
#[test]
fn run_flags_convert_into_component_types() {
    let Command::Run(args) = command(&[
        "dataplane",
        "run",
        "--threading",
        "shared",
        "--dns-capture=false",
        "--dns-upstream",
        "10.96.0.10,[fd00::a]:53",
        "--dns-domain",
        "example.org.",
    ]) else {
        panic!("`dataplane run` parsed as another command");
    };
    assert_eq!(
        crate::workers::Threading::from(args.threading),
        crate::workers::Threading::Shared
    );
    assert_eq!(
        crate::dns::DnsConfig::from(&args.dns),
        crate::dns::DnsConfig {
            default_capture: false,
            upstream: vec!["10.96.0.10".to_owned(), "[fd00::a]:53".to_owned()],
            domain: "example.org.".to_owned(),
        }
    );
}

#[test]
fn install_cni_flags_convert_into_the_installer_config() {
    let Command::InstallCni(args) = command(&[
        "dataplane",
        "install-cni",
        "--on-agent-unreachable",
        "pass",
        "--once",
    ]) else {
        panic!("`dataplane install-cni` parsed as another command");
    };
    let config = crate::cni::install::InstallConfig::from(*args);
    assert_eq!(
        config.on_agent_unreachable,
        crate::cni::spec::UnreachablePolicy::Pass
    );
    assert!(config.once);
    assert_eq!(config.resync, std::time::Duration::from_secs(10));
}

#[test]
fn proxy_mark_accepts_hex_and_decimal() {
    assert_eq!(parse_u32("0x539"), Ok(0x539));
    assert_eq!(parse_u32("1337"), Ok(1337));
    assert!(parse_u32("mark").is_err());
}
