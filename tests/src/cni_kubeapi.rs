//! A stand-in Kubernetes API server for the CNI plugin's and the
//! reconciler's tests (no real API server can run here): plain HTTP/1.1 on
//! loopback, replaying JSON the test loads (lists, single objects) and
//! scripted watch streams, and recording every request so tests can check
//! what the client asked for (field selectors, `resourceVersion` on resumed
//! watches).
//!
//! Watches are chunked streams of newline-delimited events, as the real
//! server sends them. A scripted watch plays its steps, then either ends
//! the response (a dropped watch) or stays open, forwarding events the
//! test sends with [`FakeApi::send_event`], until the client goes away or
//! the server stops.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::Netns;

mod wire;
use wire::{decode, merge_patch, status};

/// One step of a scripted watch response.
#[derive(Debug, Clone)]
pub enum WatchStep {
    /// Send this event (`{"type": ..., "object": ...}`).
    Event(Value),
    /// End the response here (the client sees the watch drop).
    Close,
}

/// A request the server received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// `GET`, ...
    pub method: String,
    /// Path without the query.
    pub path: String,
    /// Decoded query parameters.
    pub query: BTreeMap<String, String>,
    /// The request's `Content-Type`, if any.
    pub content_type: Option<String>,
    /// The request body (patches).
    pub body: String,
}

impl Recorded {
    /// Whether this is a watch.
    pub fn is_watch(&self) -> bool {
        matches!(
            self.query.get("watch").map(String::as_str),
            Some("true" | "1")
        )
    }
}

#[derive(Default)]
struct State {
    /// What the stand-in's RBAC allows; everything when `None`.
    grants: Option<crate::kube_rbac::Grants>,
    objects: HashMap<String, Value>,
    lists: HashMap<String, VecDeque<Value>>,
    watches: HashMap<String, VecDeque<Vec<WatchStep>>>,
    live: HashMap<String, VecDeque<Value>>,
    requests: Vec<Recorded>,
}

/// Every object the server holds, by path.
pub type Objects = Arc<HashMap<String, Value>>;

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
    /// The objects after each change, for [`FakeApi::watch_objects`].
    objects: tokio::sync::watch::Sender<Objects>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Tells [`FakeApi::watch_objects`] of `state`'s objects (the state's
    /// lock held, so watchers see changes in the order they were made).
    fn objects_changed(&self, state: &State) {
        self.objects.send_replace(Arc::new(state.objects.clone()));
    }
}

/// The server; stopped on drop.
pub struct FakeApi {
    addr: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for FakeApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeApi").field("addr", &self.addr).finish()
    }
}

impl FakeApi {
    /// Listens on 127.0.0.1 of the calling thread's namespace.
    pub fn start() -> anyhow::Result<Self> {
        Self::serve(TcpListener::bind("127.0.0.1:0")?)
    }

    /// Listens on 127.0.0.1 inside `netns` (for plugins run there).
    pub fn start_in(netns: &Netns) -> anyhow::Result<Self> {
        Self::serve(netns.run(|| TcpListener::bind("127.0.0.1:0"))??)
    }

    fn serve(listener: TcpListener) -> anyhow::Result<Self> {
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            objects: tokio::sync::watch::Sender::new(Objects::default()),
        });
        let server = Arc::clone(&shared);
        let thread = std::thread::spawn(move || {
            let mut connections = Vec::new();
            while !server.stop.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let shared = Arc::clone(&server);
                        connections.push(std::thread::spawn(move || {
                            let _ = serve_connection(stream, &shared);
                        }));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
            for c in connections {
                let _ = c.join();
            }
        });
        Ok(Self {
            addr,
            shared,
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig for this server into `dir` and returns its path.
    pub fn write_kubeconfig(&self, dir: &Path) -> anyhow::Result<PathBuf> {
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\nusers:\n- name: test\n  user:\n    token: test-token\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: test\ncurrent-context: fake\n",
                self.url()
            ),
        )?;
        Ok(path)
    }

    /// Serves `object` at `path` (a GET of one object).
    pub fn set_object(&self, path: &str, object: Value) {
        let mut state = self.shared.lock();
        state.objects.insert(path.to_owned(), object);
        self.shared.objects_changed(&state);
        drop(state);
        self.shared.changed.notify_all();
    }

    /// Every object served (by path) now, then again after each change the
    /// test or a client's patch makes: what a controller's informer on
    /// this server would see (the test istiod's pods, see
    /// [`crate::istiod_kube`]).
    pub fn watch_objects(&self) -> tokio::sync::watch::Receiver<Objects> {
        self.shared.objects.subscribe()
    }

    /// The object at `path` now (patches applied).
    pub fn object(&self, path: &str) -> Option<Value> {
        self.shared.lock().objects.get(path).cloned()
    }

    /// Refuses with 403, as Kubernetes' RBAC would, every request `grants`
    /// does not allow (see [`crate::kube_rbac`]).
    pub fn enforce(&self, grants: crate::kube_rbac::Grants) {
        self.shared.lock().grants = Some(grants);
    }

    /// Queues a list response for `path`; the last one queued keeps being
    /// served.
    pub fn push_list(&self, path: &str, list: Value) {
        self.shared
            .lock()
            .lists
            .entry(path.to_owned())
            .or_default()
            .push_back(list);
    }

    /// Queues a scripted watch response for `path`. Watches beyond the
    /// queued ones stay open and forward [`FakeApi::send_event`]s.
    pub fn push_watch(&self, path: &str, steps: Vec<WatchStep>) {
        self.shared
            .lock()
            .watches
            .entry(path.to_owned())
            .or_default()
            .push_back(steps);
    }

    /// Sends an event on the open (unscripted) watch of `path`.
    pub fn send_event(&self, path: &str, event: Value) {
        self.shared
            .lock()
            .live
            .entry(path.to_owned())
            .or_default()
            .push_back(event);
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.lock().requests.clone()
    }

    /// Waits until a request matching `pred` arrived (hang guard `limit`).
    pub fn wait_for_request(
        &self,
        what: &str,
        limit: Duration,
        pred: impl Fn(&Recorded) -> bool,
    ) -> anyhow::Result<Recorded> {
        let deadline = Instant::now() + limit;
        let mut state = self.shared.lock();
        loop {
            if let Some(r) = state.requests.iter().find(|r| pred(r)) {
                return Ok(r.clone());
            }
            let now = Instant::now();
            anyhow::ensure!(
                now < deadline,
                "timed out waiting for {what}; requests: {:#?}",
                state.requests
            );
            state = match self.shared.changed.wait_timeout(state, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve_connection(stream: TcpStream, shared: &Shared) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_millis(100)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    loop {
        let Some(request) = read_request(&mut reader, shared)? else {
            return Ok(());
        };
        {
            let mut state = shared.lock();
            state.requests.push(request.clone());
        }
        shared.changed.notify_all();
        let refusal = forbidden(&request, &shared.lock());
        if request.is_watch() && refusal.is_none() {
            let keep_open = serve_watch(&request, &mut reader, &mut writer, shared)?;
            if !keep_open {
                return Ok(());
            }
        } else {
            let (status, body) = answer(&request, shared);
            let body = body.to_string();
            write!(
                writer,
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )?;
            writer.flush()?;
        }
    }
}

/// Reads one request head; `None` when the client closed or the server
/// stops.
fn read_request(
    reader: &mut BufReader<TcpStream>,
    shared: &Shared,
) -> std::io::Result<Option<Recorded>> {
    let mut head = String::new();
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) => return Ok(None),
            Ok(_) => {
                if line == "\r\n" && !head.is_empty() {
                    break;
                }
                head.push_str(&line);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(e) => return Err(e),
        }
    }
    let header = |name: &str| {
        head.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim()
                .eq_ignore_ascii_case(name)
                .then(|| value.trim().to_owned())
        })
    };
    let length: usize = header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let body = read_body(reader, shared, length.min(1 << 20))?;
    let content_type = header("content-type");
    let first = head.lines().next().unwrap_or_default();
    let mut parts = first.split_whitespace();
    let method = parts.next().unwrap_or_default().to_owned();
    let target = parts.next().unwrap_or_default();
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let query = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect();
    Ok(Some(Recorded {
        method,
        path: path.to_owned(),
        query,
        content_type,
        body: String::from_utf8_lossy(&body).into_owned(),
    }))
}

/// Reads `length` body bytes through the connection's short read timeouts.
fn read_body(
    reader: &mut BufReader<TcpStream>,
    shared: &Shared,
    length: usize,
) -> std::io::Result<Vec<u8>> {
    let mut body = vec![0u8; length];
    let mut filled = 0;
    while filled < length {
        if shared.stop.load(Ordering::SeqCst) {
            return Err(std::io::ErrorKind::Interrupted.into());
        }
        match reader.read(&mut body[filled..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(body)
}

/// The 403 for a request the enforced grants do not allow.
fn forbidden(request: &Recorded, state: &State) -> Option<Value> {
    let grants = state.grants.as_ref()?;
    let allowed = crate::kube_rbac::attributes(&request.method, &request.path, &request.query)
        .is_some_and(|(resource, verb)| grants.allows(&resource, &verb));
    (!allowed).then(|| {
        status(
            403,
            "Forbidden",
            format!(
                "{} {} is forbidden: the chart's ClusterRole does not grant it",
                request.method, request.path
            ),
        )
    })
}

fn answer(request: &Recorded, shared: &Shared) -> (&'static str, Value) {
    let mut state = shared.lock();
    if let Some(refusal) = forbidden(request, &state) {
        return ("403 Forbidden", refusal);
    }
    if request.method == "PATCH" {
        let answer = patch(request, &mut state);
        shared.objects_changed(&state);
        return answer;
    }
    if let Some(queue) = state.lists.get_mut(&request.path) {
        let list = if queue.len() > 1 {
            queue.pop_front()
        } else {
            queue.front().cloned()
        };
        if let Some(list) = list {
            return ("200 OK", list);
        }
    }
    if let Some(object) = state.objects.get(&request.path) {
        return ("200 OK", object.clone());
    }
    (
        "404 Not Found",
        status(404, "NotFound", format!("{} not found", request.path)),
    )
}

/// A merge patch of an object the test set, or of its `status`
/// subresource (which, as on a real server, takes `metadata` changes too).
fn patch(request: &Recorded, state: &mut State) -> (&'static str, Value) {
    if request.content_type.as_deref() != Some("application/merge-patch+json") {
        return (
            "415 Unsupported Media Type",
            status(
                415,
                "UnsupportedMediaType",
                "only merge patches are served".into(),
            ),
        );
    }
    let Ok(body) = serde_json::from_str::<Value>(&request.body) else {
        return (
            "400 Bad Request",
            status(400, "BadRequest", "invalid JSON".into()),
        );
    };
    let path = request
        .path
        .strip_suffix("/status")
        .unwrap_or(&request.path);
    match state.objects.get_mut(path) {
        Some(object) => {
            merge_patch(object, &body);
            ("200 OK", object.clone())
        }
        None => (
            "404 Not Found",
            status(404, "NotFound", format!("{path} not found")),
        ),
    }
}

/// Plays a watch; returns whether the connection stays usable.
fn serve_watch(
    request: &Recorded,
    reader: &mut BufReader<TcpStream>,
    writer: &mut TcpStream,
    shared: &Shared,
) -> std::io::Result<bool> {
    write!(
        writer,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )?;
    writer.flush()?;
    let script = shared
        .lock()
        .watches
        .get_mut(&request.path)
        .and_then(VecDeque::pop_front);
    let send = |writer: &mut TcpStream, event: &Value| -> std::io::Result<()> {
        let line = format!("{event}\n");
        write!(writer, "{:x}\r\n{line}\r\n", line.len())?;
        writer.flush()
    };
    if let Some(steps) = script {
        for step in steps {
            match step {
                WatchStep::Event(event) => send(writer, &event)?,
                WatchStep::Close => {
                    write!(writer, "0\r\n\r\n")?;
                    writer.flush()?;
                    // Drop the connection too, as a failing proxy would.
                    return Ok(false);
                }
            }
        }
    }
    // Stay open, forwarding live events, until the client leaves.
    let mut probe = [0u8; 1];
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return Ok(false);
        }
        let events: Vec<Value> = shared
            .lock()
            .live
            .get_mut(&request.path)
            .map(|q| q.drain(..).collect())
            .unwrap_or_default();
        for event in &events {
            send(writer, event)?;
        }
        match reader.get_mut().read(&mut probe) {
            Ok(0) => return Ok(false),
            Ok(_) => return Ok(false),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Ok(false),
        }
    }
}

/// Loads a fixture (JSON with `{{NAME}}` placeholders) from
/// `tests/tests/kube_fixtures/`, substituting `vars`.
pub fn fixture(name: &str, vars: &[(&str, &str)]) -> anyhow::Result<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/kube_fixtures")
        .join(name);
    let mut text = std::fs::read_to_string(&path)
        .map_err(|e| anyhow::anyhow!("cannot read fixture {}: {e}", path.display()))?;
    for (key, value) in vars {
        text = text.replace(&format!("{{{{{key}}}}}"), value);
    }
    serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("fixture {name}: {e}"))
}

/// A PodList of `pods` as a list holds them (without their `kind` and
/// `apiVersion`), at resource version 1210.
pub fn pod_list(pods: &[&Value]) -> Value {
    let items: Vec<Value> = pods
        .iter()
        .map(|pod| {
            let mut item = (*pod).clone();
            if let Some(obj) = item.as_object_mut() {
                obj.remove("kind");
                obj.remove("apiVersion");
            }
            item
        })
        .collect();
    serde_json::json!({"kind": "PodList", "apiVersion": "v1",
        "metadata": {"resourceVersion": "1210"}, "items": items})
}

/// The fixtures' namespace list (`namespaces_list.json`: `shop`,
/// `legacy`, `kube-system`) with fixed uids.
pub fn fixture_namespaces() -> anyhow::Result<Value> {
    fixture(
        "namespaces_list.json",
        &[
            ("NS_UID_SHOP", "a3c1b5e2-7f00-4b1e-9d55-0e6f7a8b9c01"),
            ("NS_UID_LEGACY", "a3c1b5e2-7f00-4b1e-9d55-0e6f7a8b9c02"),
            ("NS_UID_KUBE_SYSTEM", "a3c1b5e2-7f00-4b1e-9d55-0e6f7a8b9c03"),
        ],
    )
}

/// A pseudo-random pod uid in the API's format, unique per call.
pub fn pod_uid() -> String {
    use std::sync::atomic::AtomicU32;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        std::process::id(),
        n & 0xffff,
        nanos & 0xfff,
        (nanos >> 12) & 0xfff,
        u64::from(nanos) << 8 | u64::from(n & 0xff)
    )
}
