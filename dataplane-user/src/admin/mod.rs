//! The admin endpoint, on a loopback address only (default
//! 127.0.0.1:15000): pods live in their own network namespaces and cannot
//! reach the node's loopback, so only the node itself can.
//!
//! - `GET /config_dump`: configuration in force, enrolled pods,
//!   certificates (no keys), kernel programs and pinned maps (JSON), and
//!   ztunnel's `workloads`, `services`, `policies`, `certificates` and
//!   `workloadState` in its own forms, for `istioctl ztunnel-config`.
//! - `GET /logging`: the log filter; `POST /logging?level=<filter>` sets it
//!   (`debug`, `info,access=off`, ...).
//! - `POST /quitquitquit`: drain and exit, as SIGTERM does.
//! - `GET /debug/pprof/profile?seconds=&frequency=`: a CPU profile in
//!   pprof's protobuf form ([`profile`]); `GET /debug/pprof/heap` says why
//!   there is none of the heap.

mod profile;

use std::sync::Arc;

use http::{Method, StatusCode, request::Parts};
use tokio::{net::TcpListener, sync::Notify};

use crate::{
    httpd::{self, Answer, Handler, JSON, Reply, query_value},
    inspect::AgentView,
    logging,
};

/// Serves the admin endpoint until the task is dropped; `/quitquitquit`
/// notifies `quit`.
pub async fn serve(listener: TcpListener, view: Arc<AgentView>, quit: Arc<Notify>) {
    let handler: Handler = Arc::new(move |request| answer(request, &view, &quit));
    httpd::serve(listener, "admin", handler).await;
}

/// Every endpoint, for the answers to a wrong path or method.
const ENDPOINTS: &str = "endpoints: GET /config_dump, GET|POST /logging[?level=<filter>], \
                         POST /quitquitquit, GET /debug/pprof/profile[?seconds=&frequency=], \
                         GET /debug/pprof/heap\n";

fn answer(request: &Parts, view: &AgentView, quit: &Notify) -> Answer {
    let method = &request.method;
    match request.uri.path() {
        "/debug/pprof/profile" if method == Method::GET => profile::cpu(request),
        "/debug/pprof/heap" if method == Method::GET => profile::heap(),
        path => plain(path, request, view, quit).into(),
    }
}

fn plain(path: &str, request: &Parts, view: &AgentView, quit: &Notify) -> Reply {
    let method = &request.method;
    match path {
        "/config_dump" if method == Method::GET => {
            match serde_json::to_string_pretty(&view.config_dump()) {
                Ok(mut body) => {
                    body.push('\n');
                    Reply {
                        status: StatusCode::OK,
                        content_type: JSON,
                        body: body.into(),
                    }
                }
                Err(err) => Reply::text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("cannot encode the dump: {err}\n"),
                ),
            }
        }
        "/logging" if method == Method::GET || method == Method::POST => {
            match query_value(request.uri.query(), "level") {
                None => Reply::text(
                    StatusCode::OK,
                    format!(
                        "log filter: {}\n",
                        logging::current_filter().unwrap_or_else(|| "-".to_owned())
                    ),
                ),
                Some(_) if method == Method::GET => Reply::text(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "changing the log filter needs POST /logging?level=<filter>\n",
                ),
                Some(level) => match logging::set_filter(level) {
                    Ok(previous) => {
                        tracing::info!(filter = level, previous, "log filter changed");
                        Reply::text(
                            StatusCode::OK,
                            format!("log filter: {level} (was {previous})\n"),
                        )
                    }
                    Err(err) => Reply::text(
                        StatusCode::BAD_REQUEST,
                        format!("{}\n", logging::Chain(&err)),
                    ),
                },
            }
        }
        "/quitquitquit" if method == Method::POST => {
            quit.notify_one();
            Reply::text(StatusCode::OK, "draining, then exiting\n")
        }
        "/config_dump"
        | "/logging"
        | "/quitquitquit"
        | "/debug/pprof/profile"
        | "/debug/pprof/heap" => Reply::text(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("method not allowed; {ENDPOINTS}"),
        ),
        _ => Reply::text(StatusCode::NOT_FOUND, ENDPOINTS),
    }
}
