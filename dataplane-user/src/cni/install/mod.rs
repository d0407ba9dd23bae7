//! `dataplane install-cni`: puts the CNI plugin on the node and keeps it
//! there, from a container of the agent's DaemonSet pod.
//!
//! 1. Copies the plugin binary into the host's CNI bin directory (write to
//!    a temporary file in that directory, then rename: the runtime never
//!    runs a half-written binary).
//! 2. Writes a kubeconfig for the plugin ([`kubeconfig`]) and keeps the
//!    service-account token it names fresh.
//! 3. Inserts the plugin once into the primary CNI configuration
//!    ([`conflist`]).
//! 4. Watches the configuration directory (inotify, plus a periodic check)
//!    and repeats 1-3 when another component rewrites a file, e.g. the
//!    primary CNI's own installer.
//! 5. On SIGTERM/SIGINT, with `--cleanup-on-exit`, takes the plugin out of
//!    the configuration (restoring a converted `.conf`) and removes the
//!    binary, kubeconfig and token. Without it everything stays, so pods
//!    created while the agent restarts still go through the plugin.

pub mod conflist;
pub mod kubeconfig;

use std::{
    io::Write as _,
    os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use serde_json::Value;
use tracing::{info, warn};

use super::spec::{PLUGIN_TYPE, UnreachablePolicy};
use crate::logging::Chain;

/// What `dataplane install-cni` installs where (from its flags, see
/// `cli::install_cni`).
#[derive(Debug, Clone)]
pub struct InstallConfig {
    /// The plugin binary to copy; `None`: `dataplane-cni` beside this
    /// executable.
    pub plugin_binary: Option<PathBuf>,
    /// The host's CNI bin directory, as mounted in this container.
    pub cni_bin_dir: PathBuf,
    /// The host's CNI configuration directory, as mounted in this
    /// container.
    pub cni_conf_dir: PathBuf,
    /// [`cni_conf_dir`](Self::cni_conf_dir) as the host sees it: the paths
    /// written into configuration files.
    pub host_cni_conf_dir: PathBuf,
    /// The configuration file (a name in `cni_conf_dir`) to insert the
    /// plugin into; `None`: the first one by name.
    pub conf_file: Option<String>,
    /// The agent's control socket, as the host sees it.
    pub agent_socket: PathBuf,
    /// What the plugin does when the agent cannot be reached.
    pub on_agent_unreachable: UnreachablePolicy,
    /// Namespaces the plugin never enrolls.
    pub exclude_namespaces: Vec<String>,
    /// Which pods the plugin enrolls; `None`: Istio's default selectors.
    pub enablement_selectors: Option<crate::kube::optin::EnablementSelectors>,
    /// SPIFFE trust domain of the pods' identities.
    pub trust_domain: String,
    /// The Kubernetes API server the plugin asks; `None`: from
    /// `KUBERNETES_SERVICE_HOST`/`PORT`.
    pub kube_api_server: Option<String>,
    /// Write no kubeconfig (the plugin then enrolls every pod).
    pub no_kubeconfig: bool,
    /// The service-account token copied to the host for the plugin.
    pub kube_token_file: PathBuf,
    /// The API server's CA bundle.
    pub kube_ca_file: PathBuf,
    /// Install once and return instead of watching.
    pub once: bool,
    /// Remove everything installed and return.
    pub uninstall: bool,
    /// On SIGTERM/SIGINT, take the plugin out of the configuration and the
    /// bin directory.
    pub cleanup_on_exit: bool,
    /// How often the installation is checked besides change
    /// notifications.
    pub resync: Duration,
}

/// Errors installing the plugin.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// A file could not be read or written.
    #[error("{what} {path}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A configuration file is unusable.
    #[error(transparent)]
    Conf(#[from] conflist::ConfError),
    /// Watching the configuration directory failed.
    #[error("cannot watch {path} for changes")]
    Watch {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: nix::Error,
    },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> InstallError {
    let path = path.to_path_buf();
    move |source| InstallError::Io { what, path, source }
}

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Installed {
    /// The configuration the plugin is in (`None`: no configuration yet).
    pub config: Option<PathBuf>,
    /// Whether anything was written.
    pub changed: bool,
}

/// The installer, from its configuration.
#[derive(Debug)]
pub struct Installer {
    config: InstallConfig,
    plugin_binary: PathBuf,
    server: Option<String>,
}

impl Installer {
    /// An installer for `config`.
    pub fn new(config: InstallConfig) -> Result<Self, InstallError> {
        let plugin_binary = match &config.plugin_binary {
            Some(path) => path.clone(),
            None => {
                let exe = std::env::current_exe()
                    .map_err(io_err("cannot locate", Path::new("/proc/self/exe")))?;
                exe.with_file_name(PLUGIN_TYPE)
            }
        };
        let server = if config.no_kubeconfig {
            None
        } else {
            config
                .kube_api_server
                .clone()
                .or_else(|| kubeconfig::in_cluster_server(|name| std::env::var(name).ok()))
        };
        Ok(Self {
            config,
            plugin_binary,
            server,
        })
    }

    fn kubeconfig_path(&self) -> PathBuf {
        self.config.cni_conf_dir.join(kubeconfig::KUBECONFIG_NAME)
    }

    fn token_path(&self) -> PathBuf {
        self.config.cni_conf_dir.join(kubeconfig::TOKEN_NAME)
    }

    fn installed_binary(&self) -> PathBuf {
        self.config.cni_bin_dir.join(PLUGIN_TYPE)
    }

    /// The plugin's entry in the configuration list.
    pub fn plugin_config(&self) -> Value {
        let mut conf = serde_json::json!({
            "type": PLUGIN_TYPE,
            "agentSocket": self.config.agent_socket,
            "onAgentUnreachable": self.config.on_agent_unreachable,
            "trustDomain": self.config.trust_domain,
            "excludeNamespaces": self.config.exclude_namespaces,
        });
        if let Some(selectors) = &self.config.enablement_selectors {
            conf["enablementSelectors"] = serde_json::to_value(&selectors.0).unwrap_or_default();
        }
        if self.server.is_some() {
            conf["kubeconfig"] = self
                .config
                .host_cni_conf_dir
                .join(kubeconfig::KUBECONFIG_NAME)
                .display()
                .to_string()
                .into();
        }
        conf
    }

    /// One pass: binary, kubeconfig and token, configuration.
    pub fn install_once(&self) -> Result<Installed, InstallError> {
        let mut changed = self.install_binary()?;
        changed |= self.install_kubeconfig()?;
        let config = match &self.config.conf_file {
            Some(name) => {
                let path = self.config.cni_conf_dir.join(name);
                path.exists().then_some(path)
            }
            None => conflist::primary(&self.config.cni_conf_dir)
                .map_err(io_err("cannot list", &self.config.cni_conf_dir))?,
        };
        let Some(config) = config else {
            return Ok(Installed {
                config: None,
                changed,
            });
        };
        let text = std::fs::read_to_string(&config).map_err(io_err("cannot read", &config))?;
        let mut installed_in = config.clone();
        if let Some(edit) = conflist::insert(&config, &text, &self.plugin_config())? {
            installed_in = edit.write.clone();
            apply(&edit)?;
            info!(config = %edit.write.display(), "plugin inserted into the CNI configuration");
            changed = true;
        }
        Ok(Installed {
            config: Some(installed_in),
            changed,
        })
    }

    fn install_binary(&self) -> Result<bool, InstallError> {
        let source = std::fs::read(&self.plugin_binary)
            .map_err(io_err("cannot read the plugin binary", &self.plugin_binary))?;
        let target = self.installed_binary();
        if std::fs::read(&target).is_ok_and(|current| current == source) {
            return Ok(false);
        }
        std::fs::create_dir_all(&self.config.cni_bin_dir)
            .map_err(io_err("cannot create", &self.config.cni_bin_dir))?;
        write_atomic(&target, &source, 0o755)?;
        info!(binary = %target.display(), "plugin binary installed");
        Ok(true)
    }

    fn install_kubeconfig(&self) -> Result<bool, InstallError> {
        let Some(server) = &self.server else {
            return Ok(false);
        };
        let mut changed = false;
        // The token first: the kubeconfig must never name a missing file.
        match std::fs::read(&self.config.kube_token_file) {
            Ok(token) => changed |= write_if_changed(&self.token_path(), &token, 0o600)?,
            Err(err) => {
                warn!(token = %self.config.kube_token_file.display(), error = %err, "no service-account token to copy; the plugin's API look-ups will fail")
            }
        }
        let ca = std::fs::read(&self.config.kube_ca_file).ok();
        let text = kubeconfig::render(
            server,
            ca.as_deref(),
            &self.config.host_cni_conf_dir.join(kubeconfig::TOKEN_NAME),
        );
        changed |= write_if_changed(&self.kubeconfig_path(), text.as_bytes(), 0o600)?;
        Ok(changed)
    }

    /// Takes everything out again: the plugin from every configuration in
    /// the directory, the binary, the kubeconfig and token.
    pub fn uninstall(&self) -> Result<(), InstallError> {
        let dir = &self.config.cni_conf_dir;
        let entries = std::fs::read_dir(dir).map_err(io_err("cannot list", dir))?;
        for entry in entries.flatten() {
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if !conflist::is_config_name(&name) {
                continue;
            }
            let path = entry.path();
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            match conflist::remove(&path, &text) {
                Ok(Some(edit)) => {
                    apply(&edit)?;
                    info!(config = %edit.write.display(), "plugin removed from the CNI configuration");
                }
                Ok(None) => {}
                Err(err) => {
                    warn!(error = %Chain(&err), "skipping a configuration that does not parse")
                }
            }
        }
        for path in [
            self.installed_binary(),
            self.kubeconfig_path(),
            self.token_path(),
        ] {
            match std::fs::remove_file(&path) {
                Ok(()) => info!(file = %path.display(), "removed"),
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(InstallError::Io {
                        what: "cannot remove",
                        path,
                        source,
                    });
                }
            }
        }
        Ok(())
    }
}

/// Writes an edit, then deletes what it replaces.
fn apply(edit: &conflist::Edit) -> Result<(), InstallError> {
    write_atomic(&edit.write, edit.text.as_bytes(), 0o644)?;
    if let Some(old) = &edit.delete {
        match std::fs::remove_file(old) {
            Ok(()) => {}
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(InstallError::Io {
                    what: "cannot remove",
                    path: old.clone(),
                    source,
                });
            }
        }
    }
    Ok(())
}

fn write_if_changed(path: &Path, content: &[u8], mode: u32) -> Result<bool, InstallError> {
    if std::fs::read(path).is_ok_and(|current| current == content) {
        return Ok(false);
    }
    write_atomic(path, content, mode)?;
    Ok(true)
}

/// Writes `content` to a hidden temporary file beside `path` (same file
/// system), syncs it, and renames it over `path`.
pub fn write_atomic(path: &Path, content: &[u8], mode: u32) -> Result<(), InstallError> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)?;
        file.write_all(content)?;
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io_err("cannot write", path))
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn request_stop(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Runs `dataplane install-cni`.
pub fn run(config: InstallConfig) -> Result<(), InstallError> {
    let installer = Installer::new(config)?;
    if installer.config.uninstall {
        return installer.uninstall();
    }
    install_signal_handlers();
    let dir = installer.config.cni_conf_dir.clone();
    std::fs::create_dir_all(&dir).map_err(io_err("cannot create", &dir))?;
    // Watch before the first pass: a write racing with it is not missed.
    let watch_err = |source| InstallError::Watch {
        path: dir.clone(),
        source,
    };
    let inotify =
        Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).map_err(watch_err)?;
    inotify
        .add_watch(
            &dir,
            AddWatchFlags::IN_CLOSE_WRITE
                | AddWatchFlags::IN_MOVED_TO
                | AddWatchFlags::IN_MOVED_FROM
                | AddWatchFlags::IN_CREATE
                | AddWatchFlags::IN_DELETE,
        )
        .map_err(watch_err)?;
    report(installer.install_once()?, &dir);
    if installer.config.once {
        return Ok(());
    }
    info!(dir = %dir.display(), resync = ?installer.config.resync, "watching the CNI configuration");
    let mut next_resync = Instant::now() + installer.config.resync;
    while !STOP.load(Ordering::SeqCst) {
        let changed = wait_for_change(&inotify, Duration::from_millis(500));
        let due = Instant::now() >= next_resync;
        if !changed && !due {
            continue;
        }
        if due {
            next_resync = Instant::now() + installer.config.resync;
        }
        match installer.install_once() {
            Ok(installed) if installed.changed => report(installed, &dir),
            Ok(_) => {}
            Err(err) => warn!(error = %Chain(&err), "re-installing the plugin failed; retrying"),
        }
    }
    info!("stopping");
    if installer.config.cleanup_on_exit {
        installer.uninstall()?;
    }
    Ok(())
}

fn report(installed: Installed, dir: &Path) {
    match installed.config {
        Some(config) => info!(config = %config.display(), "plugin installed"),
        None => {
            warn!(dir = %dir.display(), "no CNI configuration yet; waiting for the primary network plugin to write one")
        }
    }
}

/// Waits up to `timeout` for directory events; drains them. True when a
/// relevant event arrived (our own hidden temporary files do not count).
fn wait_for_change(inotify: &Inotify, timeout: Duration) -> bool {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let mut pollfd = libc::pollfd {
        fd: inotify.as_fd().as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let millis = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd; a signal interrupts it with EINTR, which is
    // how SIGTERM reaches the loop.
    let ready = unsafe { libc::poll(&raw mut pollfd, 1, millis) };
    if ready <= 0 {
        return false;
    }
    let mut relevant = false;
    while let Ok(events) = inotify.read_events() {
        if events.is_empty() {
            break;
        }
        relevant |= events.iter().any(|e| {
            e.name
                .as_ref()
                .and_then(|n| n.to_str())
                .is_none_or(|n| !n.starts_with('.'))
        });
    }
    // Let a burst of writes (write + rename) settle.
    std::thread::sleep(Duration::from_millis(50));
    relevant
}

fn install_signal_handlers() {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    // No SA_RESTART: poll() returns EINTR and the loop sees the flag.
    let action = SigAction::new(
        SigHandler::Handler(request_stop),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for signal in [Signal::SIGTERM, Signal::SIGINT] {
        // SAFETY: the handler only stores to an atomic.
        if let Err(err) = unsafe { sigaction(signal, &action) } {
            warn!(?signal, error = %err, "cannot install a signal handler");
        }
    }
}
