//! The enrollment actor: one thread owns the enrolled pods and the kernel
//! programs, and takes commands from the control socket, configuration
//! reloads, the Kubernetes reconciler and start-up through an
//! [`Enroller`] handle.
//!
//! Enrolling a pod generates a key, signs a certificate, enters a network
//! namespace, creates listeners, writes maps, attaches `sk_lookup` and
//! rewrites the state file: milliseconds of blocking work that must not
//! run on the engine's async worker threads, where it would delay every
//! connection's next byte. Commands are handled one at a time, in order;
//! readers of the pod list ([`PodsView`]) never wait for them, they see
//! the list as of the last completed command.
//!
//! The actor also checks every [`REAP_INTERVAL`] for pods whose network
//! namespace is gone.

use std::{
    path::PathBuf,
    sync::{Arc, mpsc},
    time::{Duration, Instant},
};

use tokio::sync::{oneshot, watch};
use tracing::{info, warn};

use super::{
    DepartedPod, EnrollError, Enrollments, HandedPod, OfferedPod, PodSpec, PodStatus, Standalone,
    ZtunnelEvent,
};
use crate::{config::LocalConfig, logging::Chain, redirect::ExitMode};

/// How often enrolled pods' network namespaces are checked for removal.
pub const REAP_INTERVAL: Duration = Duration::from_secs(2);

/// The pods as of the last completed command.
#[derive(Debug, Clone, Default)]
pub struct EnrolledSnapshot {
    /// Enrolled pods, by uid.
    pub pods: Vec<PodStatus>,
    /// Pods recently unenrolled or refused (oldest first), and why.
    pub departed: Vec<DepartedPod>,
}

/// Reads the enrolled pods without waiting for the actor.
#[derive(Debug, Clone)]
pub struct PodsView(watch::Receiver<Arc<EnrolledSnapshot>>);

impl PodsView {
    /// The pods as of the last completed command.
    pub fn snapshot(&self) -> Arc<EnrolledSnapshot> {
        Arc::clone(&self.0.borrow())
    }

    /// Waits until a snapshot newer than the last one read is published;
    /// an error once the actor is gone.
    pub async fn changed(&mut self) -> Result<(), watch::error::RecvError> {
        self.0.changed().await
    }
}

type Reply<T> = oneshot::Sender<Result<T, EnrollError>>;

enum Command {
    Readopt(Reply<usize>),
    ReadoptHanded(Vec<HandedPod>, Reply<usize>),
    Freeze(Reply<Vec<OfferedPod>>),
    Thaw(Reply<()>),
    Release(Reply<()>),
    Add(Box<PodSpec>, Reply<PodStatus>),
    Remove(String, Reply<bool>),
    RemoveByNetns(PathBuf, Reply<Option<String>>),
    ApplyConfig(Arc<LocalConfig>, Reply<()>),
    Shutdown(ExitMode, Reply<()>),
    StartZtunnel(Reply<()>),
    Ztunnel(ZtunnelEvent),
}

/// Sends commands to the enrollment actor and awaits their results.
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct Enroller {
    commands: mpsc::Sender<Command>,
    view: PodsView,
}

impl Enroller {
    /// Starts the actor on a thread of its own that owns `enrollments`
    /// (and through them the kernel programs). `standalone` enrolls the
    /// configured workloads on [`Enroller::apply_config`]. Tasks the pods'
    /// engines spawn run on the current tokio runtime.
    pub fn start(enrollments: Enrollments, standalone: Standalone) -> Result<Self, EnrollError> {
        let (commands, inbox) = mpsc::channel();
        let (publish, view) = watch::channel(Arc::new(EnrolledSnapshot::default()));
        let runtime = tokio::runtime::Handle::current();
        let mut actor = Actor {
            enrollments: Some(enrollments),
            frozen: false,
            standalone,
            publish,
        };
        std::thread::Builder::new()
            .name("dp-enroll".into())
            .spawn(move || {
                let _runtime = runtime.enter();
                actor.run(&inbox);
            })
            .map_err(EnrollError::Actor)?;
        Ok(Self {
            commands,
            view: PodsView(view),
        })
    }

    /// Reads the pod list without waiting for the actor.
    pub fn view(&self) -> PodsView {
        self.view.clone()
    }

    /// Re-adopts the pods a previous agent of this instance enrolled;
    /// returns how many.
    pub async fn readopt(&self) -> Result<usize, EnrollError> {
        self.ask(Command::Readopt).await
    }

    /// Re-adopts the pods a previous agent handed over, on the sockets it
    /// passed (see [`Enrollments::readopt_handed`]); returns how many.
    pub async fn readopt_handed(&self, pods: Vec<HandedPod>) -> Result<usize, EnrollError> {
        self.ask(|reply| Command::ReadoptHanded(pods, reply)).await
    }

    /// Freezes the pod set for a hand-over and returns every pod with
    /// duplicates of its listening sockets. Until [`Enroller::thaw`] (the
    /// hand-over failed) or [`Enroller::release`] (it succeeded),
    /// enrollment changes are refused ([`EnrollError::HandingOver`]) and
    /// vanished namespaces are not reaped: the new agent re-adopts exactly
    /// what was offered.
    pub async fn freeze(&self) -> Result<Vec<OfferedPod>, EnrollError> {
        self.ask(Command::Freeze).await
    }

    /// Ends a freeze: the hand-over failed, this agent goes on.
    pub async fn thaw(&self) -> Result<(), EnrollError> {
        self.ask(Command::Thaw).await
    }

    /// After a hand-over: stops every pod's engine and leaves kernel state
    /// and the state file to the new agent; the actor then exits.
    pub async fn release(&self) -> Result<(), EnrollError> {
        self.ask(Command::Release).await
    }

    /// Enrolls a pod (see [`Enrollments::add`]).
    pub async fn add(&self, spec: PodSpec) -> Result<PodStatus, EnrollError> {
        self.ask(|reply| Command::Add(Box::new(spec), reply)).await
    }

    /// Unenrolls the pod with this uid; whether it was enrolled.
    pub async fn remove(&self, uid: String) -> Result<bool, EnrollError> {
        self.ask(|reply| Command::Remove(uid, reply)).await
    }

    /// Unenrolls the pod enrolled with this netns path; its uid, if any.
    pub async fn remove_by_netns(&self, netns: PathBuf) -> Result<Option<String>, EnrollError> {
        self.ask(|reply| Command::RemoveByNetns(netns, reply)).await
    }

    /// Enrolls, re-enrolls and unenrolls the configured workloads of this
    /// node (standalone mode). Failures of single pods are logged and
    /// shown in status; the others go on.
    pub async fn apply_config(&self, config: Arc<LocalConfig>) -> Result<(), EnrollError> {
        self.ask(|reply| Command::ApplyConfig(config, reply)).await
    }

    /// Stops every pod's engine and keeps or removes kernel state as `mode`
    /// says; the actor then exits.
    pub async fn shutdown(&self, mode: ExitMode) -> Result<(), EnrollError> {
        self.ask(|reply| Command::Shutdown(mode, reply)).await
    }

    /// [`Enroller::add`] for callers on a blocking thread (never on an
    /// async worker thread: it waits).
    pub fn add_blocking(&self, spec: PodSpec) -> Result<PodStatus, EnrollError> {
        self.ask_blocking(|reply| Command::Add(Box::new(spec), reply))
    }

    /// [`Enroller::remove`] for callers on a blocking thread.
    pub fn remove_blocking(&self, uid: String) -> Result<bool, EnrollError> {
        self.ask_blocking(|reply| Command::Remove(uid, reply))
    }

    /// Starts serving ZDS to ztunnel (`--engine ztunnel`), once the pods
    /// enrolled before (re-adopted) are known: they make the first
    /// snapshot. Does nothing for the builtin engine.
    pub async fn start_ztunnel(&self) -> Result<(), EnrollError> {
        self.ask(Command::StartZtunnel).await
    }

    /// Hands an event of a ztunnel connection to the actor; never blocks.
    pub fn notify_ztunnel(&self, event: ZtunnelEvent) {
        // The actor is gone only when the agent stops.
        let _ = self.commands.send(Command::Ztunnel(event));
    }

    fn send<T>(
        &self,
        command: impl FnOnce(Reply<T>) -> Command,
    ) -> Result<oneshot::Receiver<Result<T, EnrollError>>, EnrollError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(command(reply))
            .map_err(|_| EnrollError::ActorGone)?;
        Ok(answer)
    }

    async fn ask<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Result<T, EnrollError> {
        self.send(command)?
            .await
            .map_err(|_| EnrollError::ActorGone)?
    }

    fn ask_blocking<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Result<T, EnrollError> {
        self.send(command)?
            .blocking_recv()
            .map_err(|_| EnrollError::ActorGone)?
    }
}

struct Actor {
    /// `None` once shut down.
    enrollments: Option<Enrollments>,
    /// Set while a hand-over is under way: no enrollment changes.
    frozen: bool,
    standalone: Standalone,
    publish: watch::Sender<Arc<EnrolledSnapshot>>,
}

impl Actor {
    fn run(&mut self, inbox: &mpsc::Receiver<Command>) {
        let mut next_reap = Instant::now() + REAP_INTERVAL;
        while self.enrollments.is_some() {
            let wait = next_reap.saturating_duration_since(Instant::now());
            match inbox.recv_timeout(wait) {
                Ok(command) => self.handle(command),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                // Every handle is gone without a shutdown: keep kernel
                // state, as a crash would.
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
            if Instant::now() >= next_reap {
                if !self.frozen
                    && let Some(enrollments) = self.enrollments.as_mut()
                    && !enrollments.reap_vanished().is_empty()
                {
                    self.publish();
                }
                next_reap = Instant::now() + REAP_INTERVAL;
            }
        }
    }

    fn handle(&mut self, command: Command) {
        let Some(enrollments) = self.enrollments.as_mut() else {
            return;
        };
        // While frozen for a hand-over, nothing changes the pod set.
        let frozen = self.frozen;
        // The pod list is published before the reply goes out: a client
        // that enrolled a pod and then asks for status must see it.
        match command {
            Command::ReadoptHanded(pods, reply) => {
                let result = match frozen {
                    true => Err(EnrollError::HandingOver),
                    false => enrollments.readopt_handed(pods),
                };
                self.reply(reply, result);
            }
            Command::Freeze(reply) => {
                let result = enrollments.offer();
                self.frozen = result.is_ok();
                let _ = reply.send(result);
            }
            Command::Thaw(reply) => {
                self.frozen = false;
                let _ = reply.send(Ok(()));
            }
            Command::Release(reply) => {
                if let Some(enrollments) = self.enrollments.take() {
                    enrollments.release();
                }
                info!("enrollment actor stopped; pods handed over");
                self.publish.send_replace(Arc::default());
                let _ = reply.send(Ok(()));
            }
            Command::Readopt(reply) => {
                let result = match frozen {
                    true => Err(EnrollError::HandingOver),
                    false => enrollments.readopt(),
                };
                self.reply(reply, result);
            }
            Command::Add(spec, reply) => {
                let result = match frozen {
                    true => Err(EnrollError::HandingOver),
                    false => enrollments.add(*spec),
                };
                self.reply(reply, result);
            }
            Command::Remove(uid, reply) => {
                let result = match frozen {
                    true => Err(EnrollError::HandingOver),
                    false => enrollments.remove(&uid),
                };
                self.reply(reply, result);
            }
            Command::RemoveByNetns(netns, reply) => {
                let result = match frozen {
                    true => Err(EnrollError::HandingOver),
                    false => enrollments.remove_by_netns(&netns),
                };
                self.reply(reply, result);
            }
            Command::ApplyConfig(config, reply) => {
                if frozen {
                    self.reply(reply, Err(EnrollError::HandingOver));
                    return;
                }
                self.standalone.apply(enrollments, &config);
                self.reply(reply, Ok(()));
            }
            Command::StartZtunnel(reply) => {
                let result = enrollments.start_ztunnel_server();
                self.reply(reply, result);
            }
            Command::Ztunnel(event) => {
                match event {
                    ZtunnelEvent::Acked { uid, peer } => enrollments.ztunnel_acked(&uid, peer),
                    ZtunnelEvent::Disconnected(peer) => enrollments.ztunnel_disconnected(peer),
                    ZtunnelEvent::Refused { uid, problem } => {
                        enrollments.ztunnel_refused(&uid, problem);
                    }
                }
                self.publish();
            }
            Command::Shutdown(mode, reply) => {
                let result = match self.enrollments.take() {
                    Some(enrollments) => enrollments.shutdown(mode),
                    None => Ok(()),
                };
                if let Err(err) = &result {
                    warn!(error = %Chain(err), "stopping the enrolled pods failed");
                } else {
                    info!(?mode, "enrollment actor stopped");
                }
                self.publish.send_replace(Arc::default());
                let _ = reply.send(result);
            }
        }
    }

    /// Publishes the pod list, then answers.
    fn reply<T>(&self, reply: Reply<T>, result: Result<T, EnrollError>) {
        self.publish();
        let _ = reply.send(result);
    }

    fn publish(&self) {
        if let Some(enrollments) = &self.enrollments {
            self.publish.send_replace(Arc::new(EnrolledSnapshot {
                pods: enrollments.list(),
                departed: enrollments.departed(),
            }));
        }
    }
}
