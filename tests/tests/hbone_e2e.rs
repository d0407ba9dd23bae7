//! HBONE end to end: two simulated nodes, one agent per node, pods enrolled
//! from a shared local config (standalone mode), one built-in CA. Captured
//! connections to mesh workloads travel in mutual-TLS HTTP/2 CONNECT tunnels;
//! identities, trust domains and CAs are enforced in the handshake.
//!
//! Certificates and carriage come from the agents' certificate lists and
//! `/metrics`. Access records (log target `access`) are matched as log text
//! because operators consume those lines: their text is the product; so is
//! the pool's `HBONE connection established` line, the only report of a
//! handshake.

#[path = "hbone_e2e/carriage.rs"]
mod carriage;

#[path = "hbone_e2e/peers.rs"]
mod peers;

#[path = "hbone_e2e/failures.rs"]
mod failures;

#[path = "hbone_e2e/revocation.rs"]
mod revocation;

use std::{collections::HashSet, net::SocketAddr};

use dataplane_tests::{
    Agent,
    capture::PacketCapture,
    mesh::{TwoNodes, addr, write_config},
    observe::{access_records, family, field, scrape, sum_matching},
    traffic::{echo, echo_server, holding_server, stream, try_stream, wait_until},
};
use dataplane_user::control::Request;

const MIB: usize = 1024 * 1024;
