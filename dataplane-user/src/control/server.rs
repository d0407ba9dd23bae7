//! Serving the control socket.

use std::{io, os::unix::fs::PermissionsExt, path::Path, sync::Arc, time::Duration};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{UnixListener, UnixStream},
};
use tracing::{debug, warn};

use super::{MAX_MESSAGE, Request, Response};
use crate::{inspect::AgentView, logging::Chain};

/// How long a client may take to send its whole request; one that
/// connects and stays silent is closed after this.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Control connections served at once; more are refused at once (each
/// holds a descriptor, and an enrollment waits its turn at the actor).
pub const MAX_CLIENTS: usize = 128;

/// Binds the control socket at `path` (replacing a stale one left by a dead
/// agent) with mode 0600.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => return Err(err),
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Answers requests until the task is dropped.
pub async fn serve(listener: UnixListener, view: Arc<AgentView>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CLIENTS));
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                    warn!(
                        max = MAX_CLIENTS,
                        "too many control connections; refusing one"
                    );
                    let reply = refused(format!(
                        "the agent is serving {MAX_CLIENTS} control connections already; retry"
                    ));
                    // One attempt that cannot wait, then the descriptor goes:
                    // a flood must not hold tasks or descriptors of its own.
                    if let Ok(bytes) = serde_json::to_vec(&reply) {
                        let _ = stream.try_write(&bytes);
                    }
                    continue;
                };
                let view = Arc::clone(&view);
                tokio::spawn(async move {
                    if let Err(err) = answer(stream, &view).await {
                        debug!(error = %err, "control connection failed");
                    }
                    drop(slot);
                });
            }
            Err(err) => warn!(error = %err, "control socket accept failed"),
        }
    }
}

async fn answer(mut stream: UnixStream, view: &AgentView) -> io::Result<()> {
    let mut body = Vec::new();
    let mut limited = (&mut stream).take(MAX_MESSAGE + 1);
    match tokio::time::timeout(REQUEST_TIMEOUT, limited.read_to_end(&mut body)).await {
        Ok(result) => {
            result?;
        }
        Err(_) => {
            debug!("control client sent no complete request in time; closing");
            return Ok(());
        }
    }
    let response = match super::read_request(&body) {
        Ok(request) => handle(request, view).await,
        Err(refusal) => refused(refusal),
    };
    let reply = serde_json::to_vec(&response).map_err(io::Error::from)?;
    stream.write_all(&reply).await?;
    stream.shutdown().await
}

async fn handle(request: Request, view: &AgentView) -> Response {
    let report = |value: Result<serde_json::Value, serde_json::Error>| match value {
        Ok(value) => Response {
            ok: true,
            report: Some(value),
            ..Response::default()
        },
        Err(err) => refused(format!("cannot encode the report: {err}")),
    };
    // Enrollment commands wait for the enrollment actor; reports and the
    // pod list read its last published state.
    match request {
        Request::Status => report(serde_json::to_value(view.status())),
        Request::ConfigDump => report(Ok(view.config_dump())),
        Request::Certs => report(serde_json::to_value(view.certs())),
        Request::Add { pod } => match view.enroller.add(*pod).await {
            Ok(status) => Response {
                ok: true,
                pods: vec![status],
                ..Response::default()
            },
            Err(err) => refused(Chain(&err).to_string()),
        },
        Request::Remove { uid, netns } => {
            let result = match (uid, netns) {
                (Some(uid), _) => view.enroller.remove(uid).await,
                (None, Some(netns)) => view
                    .enroller
                    .remove_by_netns(netns)
                    .await
                    .map(|r| r.is_some()),
                (None, None) => return refused("remove needs a uid or a netns".into()),
            };
            match result {
                Ok(removed) => Response {
                    ok: true,
                    removed: Some(removed),
                    ..Response::default()
                },
                Err(err) => refused(Chain(&err).to_string()),
            }
        }
        Request::List => Response {
            ok: true,
            pods: view.enroller.view().snapshot().pods.clone(),
            ..Response::default()
        },
    }
}

fn refused(error: String) -> Response {
    Response {
        ok: false,
        error: Some(error),
        ..Response::default()
    }
}
