//! The engine's side of `TPROXY_TUPLES`: before a transparent socket
//! connects to an app from a client's address, its tuple goes into the map
//! so that `sk_lookup` lets that SYN reach the app instead of capturing it
//! (see `proxy::original_source`).
//!
//! The engine writes it, not the `connect` programs: those run only for
//! sockets in the cgroups they are attached to, which need not include the
//! agent's own.

use std::net::SocketAddr;

use aya::maps::{HashMap, MapData};
use dataplane_common::{SockTuple, maps::TPROXY_TUPLES};

use super::{PinLayout, RedirectError, orig_dst::tuple_of, stats::open_pinned};

/// The pinned `TPROXY_TUPLES` map, opened by the engine.
pub struct TproxyTable {
    map: HashMap<MapData, SockTuple, u8>,
}

impl std::fmt::Debug for TproxyTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TproxyTable")
    }
}

impl TproxyTable {
    /// Opens the instance's pinned map.
    pub fn open(pins: &PinLayout) -> Result<Self, RedirectError> {
        Ok(Self {
            map: open_pinned(pins, TPROXY_TUPLES)?,
        })
    }

    /// Records the connection about to be made from `client` (the bound
    /// transparent socket's address) to the app at `app`.
    pub fn record(&mut self, client: SocketAddr, app: SocketAddr) -> Result<(), RedirectError> {
        self.map
            .insert(tuple_of(client, app), 0, 0)
            .map_err(|source| RedirectError::Map {
                name: TPROXY_TUPLES,
                source,
            })
    }

    /// Removes the record of a connection whose SYN never reached the app
    /// (`sk_lookup` removes the others). Absent is fine.
    pub fn forget(&mut self, client: SocketAddr, app: SocketAddr) {
        let _ = self.map.remove(&tuple_of(client, app));
    }
}
