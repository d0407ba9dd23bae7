//! An outbound connection's task, written out as a future of its own.
//!
//! Most open connections are idle, and what each one's task holds is
//! memory per connection. Until its way is open, a connection's state (the
//! plan, failover, the tunnel's opening, the direct connect) lives in a box
//! the task frees once the way is open; from then on the task holds only
//! the relay, the connection's record and the tunnel's stream slot. As an
//! `async` block it would also keep room for the box's result and for the
//! relay twice (a value moved into `.await` keeps its old place in the
//! state), about 300 bytes more per connection.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};

use crate::{
    hbone::StreamSlot,
    proxy::{PodContext, record},
    relay::{
        Transferred, plain,
        tunnel::{self, TunnelRelayError},
    },
    telemetry::OpenFlow,
};

/// What a connection relays once its way is open.
pub(super) enum Relaying {
    /// Through a tunnel: the relay, the record, the stream's slot.
    Tunnel(tunnel::Relay, OpenFlow, StreamSlot),
    /// Straight to its destination.
    Plain(plain::Relay, OpenFlow),
}

/// The way's opening, boxed: what it returns is relayed, `None` once the
/// connection was refused.
pub(super) type Opening = Pin<Box<dyn Future<Output = Option<Relaying>> + Send>>;

/// The task: opens the way, relays, writes the record.
pub(super) struct Connection {
    state: State,
    ctx: Arc<PodContext>,
}

enum State {
    Opening(Opening),
    /// The record is taken when the relay ends; the slot is held until
    /// then.
    Tunnel {
        relay: tunnel::Relay,
        open: Option<OpenFlow>,
        _slot: StreamSlot,
    },
    Plain(plain::Relay, Option<OpenFlow>),
    Done,
}

impl Connection {
    /// The task of the connection `opening` opens, for the pod of `ctx`.
    pub(super) fn new(opening: Opening, ctx: Arc<PodContext>) -> Self {
        Self {
            state: State::Opening(opening),
            ctx,
        }
    }
}

impl Future for Connection {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        loop {
            match &mut this.state {
                State::Opening(opening) => {
                    // The box goes as soon as the way is open.
                    this.state = match ready!(opening.as_mut().poll(cx)) {
                        Some(Relaying::Tunnel(relay, open, slot)) => State::Tunnel {
                            relay,
                            open: Some(open),
                            _slot: slot,
                        },
                        Some(Relaying::Plain(relay, open)) => State::Plain(relay, Some(open)),
                        None => State::Done,
                    };
                }
                State::Tunnel { relay, open, .. } => {
                    let result = ready!(Pin::new(relay).poll(cx));
                    if let Some(open) = open.take() {
                        record_tunnel(result, open, &this.ctx);
                    }
                    this.state = State::Done;
                }
                State::Plain(relay, open) => {
                    let result = ready!(Pin::new(relay).poll(cx));
                    if let Some(open) = open.take() {
                        record(result, open);
                    }
                    this.state = State::Done;
                }
                State::Done => return Poll::Ready(()),
            }
        }
    }
}

/// Writes the record of a tunnel relay that ended.
fn record_tunnel(result: Result<Transferred, TunnelRelayError>, open: OpenFlow, ctx: &PodContext) {
    match result {
        // Dropping the flow records that the agent closed it.
        Err(_) if ctx.pool.is_closed() => drop(open),
        result => record(result, open),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What every open outbound connection's task holds, idle or not.
    #[test]
    fn the_task_stays_small() {
        let size = std::mem::size_of::<Connection>();
        println!("outbound connection task: {size} bytes");
        assert!(
            size <= 448,
            "the outbound connection task grew to {size} bytes"
        );
    }
}
