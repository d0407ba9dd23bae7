//! ztunnel's environment variable names, accepted by `dataplane run` for
//! the settings both have, so a DaemonSet written for ztunnel (Istio's
//! chart sets `XDS_ADDRESS`, `CA_ADDRESS`, `ISTIO_META_CLUSTER_ID`,
//! `POD_NAME`, `NODE_NAME`, `TERMINATION_GRACE_PERIOD_SECONDS`, ...) runs
//! this agent unchanged.
//!
//! Each name is read as ztunnel reads it (`src/config.rs`
//! `construct_config` and the constants above it) and becomes the agent's
//! own flag: a flag on the command line or its `DATAPLANE_*` variable
//! wins over the ztunnel name, which wins over the flag's default. A value
//! ztunnel would accept but this agent cannot honour (a duration finer
//! than a millisecond) is refused, naming the variable, rather than read
//! differently. Values ztunnel takes inline where the flag takes a file
//! (a PEM root, a token) are written to files under the state directory.
//! An empty value counts as unset.
//!
//! Parsing takes the environment as an argument ([`parse`]), so it is
//! tested without the process's.

use std::ffi::OsString;
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use clap::{CommandFactory as _, FromArgMatches as _, parser::ValueSource};

use super::{Cli, istio::CertSourceKind};
use crate::agent::config::SYSTEM_ROOTS;

/// How a ztunnel value becomes the flag's value; `Err` says why it cannot.
type Translate = fn(&str, &Context<'_>) -> Result<String, String>;

/// What a translation may look at besides the value.
struct Context<'a> {
    /// The whole environment (some values depend on others).
    env: &'a [(String, String)],
    /// `--state-dir`, where values given inline are written as the files
    /// the agent's flags take ([`inline`]).
    state_dir: Option<&'a Path>,
}

/// One ztunnel setting the agent has as a flag.
struct Setting {
    /// ztunnel's variables, the first set one winning (ztunnel reads
    /// `ISTIO_META_CLUSTER_ID` before `CLUSTER_ID`).
    variables: &'static [&'static str],
    /// The flag's clap id (its field name).
    id: &'static str,
    /// The flag.
    flag: &'static str,
    /// The value's translation.
    translate: Translate,
    /// Only read with `--cert-source istio`: ztunnel ignores its CA
    /// settings when it has no CA client (`FAKE_CA`), as the agent has
    /// none with another source.
    istio_ca_only: bool,
}

/// The ztunnel names the agent reads, with the constant each comes from
/// in ztunnel's `src/config.rs`. The README lists them.
const SETTINGS: &[Setting] = &[
    // `IPV6_ENABLED`: `parse::<bool>`, Rust's `true`/`false` only.
    setting(&["IPV6_ENABLED"], "ipv6_enabled", "--ipv6-enabled", boolean),
    // `XDS_ADDRESS`, `CA_ADDRESS`: `validate_uri` adds `https://` when
    // the scheme is missing; the agent takes `host:port`.
    setting(
        &["XDS_ADDRESS"],
        "istiod_address",
        "--istiod-address",
        address,
    ),
    ca_setting(&["CA_ADDRESS"], "ca_address", "--ca-address", address),
    setting(
        &["ALT_XDS_HOSTNAME"],
        "istiod_server_name",
        "--istiod-server-name",
        as_is,
    ),
    ca_setting(
        &["ALT_CA_HOSTNAME"],
        "ca_server_name",
        "--ca-server-name",
        as_is,
    ),
    // `XDS_ROOT_CA`, `CA_ROOT_CA`: a file, `SYSTEM`, or the PEM itself.
    setting(
        &["XDS_ROOT_CA"],
        "istiod_root_cert",
        "--istiod-root-cert",
        xds_root,
    ),
    ca_setting(
        &["CA_ROOT_CA"],
        "ca_server_root_cert",
        "--ca-server-root-cert",
        ca_root,
    ),
    // `AUTH_TOKEN` (`TOKEN_PROVIDER_ENV`): a token file, or the token.
    setting(&["AUTH_TOKEN"], "istiod_token", "--istiod-token", token),
    setting(
        &["ISTIO_META_CLUSTER_ID", "CLUSTER_ID"],
        "cluster_id",
        "--cluster-id",
        as_is,
    ),
    setting(&["CLUSTER_DOMAIN"], "dns_domain", "--dns-domain", as_is),
    // The downward-API names Istio's chart sets; ztunnel reads them for
    // its xDS node (`src/xds/client.rs` `AdsClient::node`).
    setting(&["NODE_NAME"], "node", "--node", as_is),
    setting(&["POD_NAME"], "pod_name", "--pod-name", as_is),
    setting(
        &["POD_NAMESPACE"],
        "pod_namespace",
        "--pod-namespace",
        as_is,
    ),
    setting(&["INSTANCE_IP"], "instance_ip", "--instance-ip", as_is),
    setting(
        &["SECRET_TTL"],
        "cert_lifetime",
        "--cert-lifetime",
        duration,
    ),
    setting(&["KEEPALIVE_ENABLED"], "keepalive", "--keepalive", toggle),
    setting(
        &["KEEPALIVE_TIME"],
        "keepalive_time",
        "--keepalive-time",
        duration,
    ),
    setting(
        &["KEEPALIVE_INTERVAL"],
        "keepalive_interval",
        "--keepalive-interval",
        duration,
    ),
    setting(
        &["KEEPALIVE_RETRIES"],
        "keepalive_retries",
        "--keepalive-retries",
        integer,
    ),
    setting(
        &["POOL_MAX_STREAMS_PER_CONNECTION"],
        "hbone_pool_max_streams_per_connection",
        "--hbone-pool-max-streams-per-connection",
        integer,
    ),
    setting(
        &["POOL_UNUSED_RELEASE_TIMEOUT"],
        "hbone_pool_idle_timeout",
        "--hbone-pool-idle-timeout",
        duration,
    ),
    setting(
        &["HTTP2_STREAM_WINDOW_SIZE"],
        "http2_stream_window_size",
        "--http2-stream-window-size",
        integer,
    ),
    setting(
        &["HTTP2_CONNECTION_WINDOW_SIZE"],
        "http2_connection_window_size",
        "--http2-connection-window-size",
        integer,
    ),
    setting(
        &["HTTP2_FRAME_SIZE"],
        "http2_frame_size",
        "--http2-frame-size",
        integer,
    ),
    setting(
        &[
            "CONNECTION_TERMINATION_DEADLINE",
            "TERMINATION_GRACE_PERIOD_SECONDS",
        ],
        "drain_timeout",
        "--drain-timeout",
        termination,
    ),
    setting(
        &["ZTUNNEL_WORKER_THREADS"],
        "worker_threads",
        "--worker-threads",
        worker_threads,
    ),
    // `ENABLE_ORIG_SRC`: `parse::<bool>` into `require_original_source`,
    // `true` required, `false` never, unset where possible.
    setting(
        &["ENABLE_ORIG_SRC"],
        "original_source",
        "--original-source",
        toggle,
    ),
    // `LOCALHOST_APP_TUNNEL`: `parse_default(.., true)`, `parse::<bool>`.
    setting(
        &["LOCALHOST_APP_TUNNEL"],
        "localhost_app_tunnel",
        "--localhost-app-tunnel",
        boolean,
    ),
    // `PACKET_MARK`: the mark of ztunnel's own sockets, which capture
    // skips, as the agent's proxy mark.
    setting(&["PACKET_MARK"], "proxy_mark", "--proxy-mark", integer),
];

const fn setting(
    variables: &'static [&'static str],
    id: &'static str,
    flag: &'static str,
    translate: Translate,
) -> Setting {
    Setting {
        variables,
        id,
        flag,
        translate,
        istio_ca_only: false,
    }
}

const fn ca_setting(
    variables: &'static [&'static str],
    id: &'static str,
    flag: &'static str,
    translate: Translate,
) -> Setting {
    Setting {
        istio_ca_only: true,
        ..setting(variables, id, flag, translate)
    }
}

/// The command line `argv` with ztunnel's variables among `env` applied
/// as flags, parsed. Errors are clap's (exit 2 with the usage), a bad
/// ztunnel value naming its variable.
pub fn parse<I, T>(argv: I, env: &[(String, String)]) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let mut argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    let matches = Cli::command().try_get_matches_from(&argv)?;
    let Some(("run", run)) = matches.subcommand() else {
        return Cli::from_arg_matches(&matches);
    };
    let flags = ztunnel_flags(run, env)
        .map_err(|message| Cli::command().error(clap::error::ErrorKind::InvalidValue, message))?;
    if flags.is_empty() {
        return Cli::from_arg_matches(&matches);
    }
    // `run` is the last subcommand and takes no positional argument, so
    // flags appended at the end are its own.
    argv.extend(flags.into_iter().map(OsString::from));
    Cli::command()
        .try_get_matches_from(&argv)
        .and_then(|matches| Cli::from_arg_matches(&matches))
}

/// The value of the first of `variables` set (non-empty) in `env`, with
/// its name.
fn lookup<'a>(
    env: &'a [(String, String)],
    variables: &'static [&'static str],
) -> Option<(&'static str, &'a str)> {
    variables.iter().find_map(|variable| {
        env.iter()
            .rev()
            .find(|(name, value)| name == variable && !value.is_empty())
            .map(|(_, value)| (*variable, value.as_str()))
    })
}

/// `--flag=value` for each ztunnel variable set in `env` whose flag was
/// given neither on the command line nor under its `DATAPLANE_*` name.
fn ztunnel_flags(run: &clap::ArgMatches, env: &[(String, String)]) -> Result<Vec<String>, String> {
    let istio_ca = run.get_one::<CertSourceKind>("cert_source") == Some(&CertSourceKind::Istio);
    let state_dir = run.get_one::<PathBuf>("state_dir").map(PathBuf::as_path);
    let ctx = Context { env, state_dir };
    let mut flags = Vec::new();
    for setting in SETTINGS {
        if setting.istio_ca_only && !istio_ca {
            continue;
        }
        if matches!(
            run.value_source(setting.id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        let Some((variable, value)) = lookup(env, setting.variables) else {
            continue;
        };
        let translated = (setting.translate)(value, &ctx)
            .map_err(|reason| format!("environment variable {variable}={value:?}: {reason}"))?;
        flags.push(format!("{}={translated}", setting.flag));
    }
    Ok(flags)
}

fn as_is(value: &str, _: &Context<'_>) -> Result<String, String> {
    Ok(value.to_owned())
}

/// Rust's `bool::from_str`, as ztunnel's `parse::<bool>`.
fn boolean(value: &str, _: &Context<'_>) -> Result<String, String> {
    value
        .parse::<bool>()
        .map(|on| on.to_string())
        .map_err(|_| "ztunnel reads `true` or `false` (lowercase)".to_owned())
}

fn toggle(value: &str, ctx: &Context<'_>) -> Result<String, String> {
    boolean(value, ctx).map(|on| if on == "true" { "on" } else { "off" }.to_owned())
}

fn integer(value: &str, _: &Context<'_>) -> Result<String, String> {
    value
        .parse::<u64>()
        .map(|n| n.to_string())
        .map_err(|_| "not a whole number".to_owned())
}

/// A duration as ztunnel reads it: `src/config.rs` `parse_duration` is
/// `duration_str::parse` (crate `duration-str` 0.21, linked here too;
/// neither build turns on its grammar features `cn_unit`, `lowercase` or
/// `no_calc`, so the grammar is ztunnel's exactly: `30s`, `500ms`, `1h30m`, `1m31`,
/// `1m+30s`, `1m*3`, units `ns` to `y` in any case, a bare number being
/// seconds). The agent's durations are whole milliseconds, so a finer
/// remainder is refused rather than rounded.
fn duration(value: &str, _: &Context<'_>) -> Result<String, String> {
    let parsed = duration_str::parse(value)
        .map_err(|e| format!("not a duration as ztunnel reads it (e.g. 30s, 500ms, 1h30m): {e}"))?;
    if parsed.subsec_nanos() % 1_000_000 != 0 {
        return Err("finer than a millisecond, which the agent's durations cannot hold".to_owned());
    }
    Ok(format!("{}ms", parsed.as_millis()))
}

/// `https://host:port` or `host:port` into `host:port`: the agent speaks
/// TLS to istiod and its CA, so another scheme is refused.
fn address(value: &str, _: &Context<'_>) -> Result<String, String> {
    let rest = match value.split_once("://") {
        None => value,
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("https") => rest,
        Some(_) => return Err("only https:// (or no scheme) is supported".to_owned()),
    };
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() || rest.contains('/') {
        return Err("give host:port, optionally after https://".to_owned());
    }
    Ok(rest.to_owned())
}

fn xds_root(value: &str, ctx: &Context<'_>) -> Result<String, String> {
    root(value, ctx, "xds-root-ca.pem")
}

fn ca_root(value: &str, ctx: &Context<'_>) -> Result<String, String> {
    root(value, ctx, "ca-root-ca.pem")
}

/// `XDS_ROOT_CA`/`CA_ROOT_CA` as ztunnel's `construct_config` reads them
/// into `RootCert`: a path that exists is the file, `SYSTEM` the system
/// roots, anything else the PEM itself (`RootCert::Static`), which is
/// written to `file` under the state directory. A value that is none of
/// these would fail ztunnel when it loads the roots; it fails here.
fn root(value: &str, ctx: &Context<'_>, file: &str) -> Result<String, String> {
    if Path::new(value).exists() || value == SYSTEM_ROOTS {
        return Ok(value.to_owned());
    }
    let certificates = pem::parse_many(value)
        .map_err(|e| format!("names no file and is not SYSTEM or PEM certificates ({e})"))?;
    if !certificates.iter().any(|c| c.tag() == "CERTIFICATE") {
        return Err("names no file and is not SYSTEM or PEM certificates".to_owned());
    }
    inline(ctx, file, value)
}

/// `AUTH_TOKEN` as ztunnel reads it: a path that exists is the token
/// file (`AuthSource::Token`), anything else the token itself
/// (`AuthSource::StaticToken`, sent as `Bearer <value>`), written to a
/// file under the state directory that only the agent can read. ztunnel
/// fails sending a token that is no HTTP header value; it fails here.
fn token(value: &str, ctx: &Context<'_>) -> Result<String, String> {
    if Path::new(value).exists() {
        return Ok(value.to_owned());
    }
    if http::HeaderValue::from_str(value).is_err() {
        return Err(
            "names no file, and as the token itself it has characters an HTTP header cannot carry"
                .to_owned(),
        );
    }
    inline(ctx, "auth-token", value)
}

/// The state directory's subdirectory for values given inline.
const INLINE_DIR: &str = "ztunnel-env";

/// Writes `contents` to `<state-dir>/ztunnel-env/<file>` (directory 0700,
/// file 0600: a token is a credential), replacing it whole so an agent
/// reading it meanwhile sees the old or the new, and returns its path.
fn inline(ctx: &Context<'_>, file: &str, contents: &str) -> Result<String, String> {
    let dir = ctx
        .state_dir
        .ok_or("no --state-dir to write the inline value under")?
        .join(INLINE_DIR);
    let failed = |what: &str, path: &Path, e: std::io::Error| {
        format!(
            "writing the inline value to {what} {} failed ({e}); check --state-dir",
            path.display()
        )
    };
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|e| failed("directory", &dir, e))?;
    let path = dir.join(file);
    let staged = dir.join(format!(".{file}.{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut out = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&staged)?;
        out.write_all(contents.as_bytes())?;
        out.sync_all()?;
        fs::rename(&staged, &path)
    };
    if let Err(e) = write() {
        let _ = fs::remove_file(&staged);
        return Err(failed("file", &path, e));
    }
    path.into_os_string()
        .into_string()
        .map_err(|_| "the state directory's path is not UTF-8".to_owned())
}

/// `CONNECTION_TERMINATION_DEADLINE` (a duration), or
/// `TERMINATION_GRACE_PERIOD_SECONDS` less 5 s (less 1 s when at most 10,
/// never below 1 s), as ztunnel's `self_termination_deadline`.
fn termination(value: &str, ctx: &Context<'_>) -> Result<String, String> {
    if lookup(ctx.env, &["CONNECTION_TERMINATION_DEADLINE"]).is_some() {
        return duration(value, ctx);
    }
    let secs: u64 = value
        .parse()
        .map_err(|_| "not a whole number of seconds".to_owned())?;
    let less = if secs > 10 { 5 } else { 1 };
    Ok(format!("{}s", secs.saturating_sub(less).max(1)))
}

/// `ZTUNNEL_WORKER_THREADS`: a number (0: one per CPU) or a percentage
/// of the CPUs, rounded up, at least 1 (ztunnel's `parse_worker_threads`).
fn worker_threads(value: &str, ctx: &Context<'_>) -> Result<String, String> {
    let threads = match value.strip_suffix('%') {
        Some(percent) => {
            let percent: f64 = percent
                .parse()
                .map_err(|e| format!("invalid percentage: {e}"))?;
            if !(percent > 0.0 && percent <= 100.0) {
                return Err("percentage must be between 0 and 100".to_owned());
            }
            let threads = (cpu_count(ctx.env)? as f64 * percent / 100.0).ceil();
            (threads as usize).max(1)
        }
        None => match value.parse::<usize>() {
            Ok(0) => cpu_count(ctx.env)?,
            Ok(threads) => threads,
            Err(e) => return Err(format!("invalid number: {e}")),
        },
    };
    Ok(threads.to_string())
}

/// ztunnel's `get_cpu_count`: `ZTUNNEL_RESOURCE_CPU_LIMIT` (a Kubernetes
/// quantity, rounded up), else `ZTUNNEL_CPU_LIMIT`, else the CPUs this
/// process may use.
fn cpu_count(env: &[(String, String)]) -> Result<usize, String> {
    if let Some((variable, raw)) = lookup(env, &["ZTUNNEL_RESOURCE_CPU_LIMIT"]) {
        let cores = match raw.strip_suffix('m') {
            Some(millis) => millis.parse::<f64>().map(|m| m / 1000.0),
            None => raw.parse::<f64>(),
        }
        .map_err(|e| format!("{variable}={raw:?}: {e}"))?;
        if !cores.is_finite() || cores <= 0.0 {
            return Err(format!(
                "{variable}={raw:?}: must be a positive CPU quantity"
            ));
        }
        return Ok(cores.ceil() as usize);
    }
    if let Some((variable, raw)) = lookup(env, &["ZTUNNEL_CPU_LIMIT"]) {
        return raw.parse().map_err(|e| format!("{variable}={raw:?}: {e}"));
    }
    Ok(std::thread::available_parallelism().map_or(1, usize::from))
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a configuration the test expects must fail the test loudly when refused"
)]
#[path = "ztunnel_env_tests.rs"]
mod tests;
