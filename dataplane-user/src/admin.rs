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

use std::sync::Arc;

use http::{Method, StatusCode, request::Parts};
use tokio::{net::TcpListener, sync::Notify};

use crate::{
    httpd::{self, Handler, JSON, Reply, query_value},
    inspect::AgentView,
    logging,
};

/// Serves the admin endpoint until the task is dropped; `/quitquitquit`
/// notifies `quit`.
pub async fn serve(listener: TcpListener, view: Arc<AgentView>, quit: Arc<Notify>) {
    let handler: Handler = Arc::new(move |request| answer(request, &view, &quit));
    httpd::serve(listener, "admin", handler).await;
}

fn answer(request: &Parts, view: &AgentView, quit: &Notify) -> Reply {
    let method = &request.method;
    match request.uri.path() {
        "/config_dump" if method == Method::GET => {
            match serde_json::to_string_pretty(&view.config_dump()) {
                Ok(mut body) => {
                    body.push('\n');
                    Reply {
                        status: StatusCode::OK,
                        content_type: JSON,
                        body,
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
        "/config_dump" | "/logging" | "/quitquitquit" => Reply::text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed: GET /config_dump, GET|POST /logging[?level=], POST /quitquitquit\n",
        ),
        _ => Reply::text(
            StatusCode::NOT_FOUND,
            "endpoints: GET /config_dump, GET|POST /logging[?level=<filter>], POST /quitquitquit\n",
        ),
    }
}
