//! The agent's handles on the same-node fast path's maps (see the kernel
//! side in `dataplane-ebpf/src/fast_path.rs`): the verdict cache it
//! writes, the generation that voids it, the open connections it re-checks
//! and the ring buffer of closed connections it turns into telemetry.
//! Opened by path, like [`super::OrigDstTable`], so they live as long as
//! the agent and not as long as one loader.

use std::{collections::HashMap as StdHashMap, net::SocketAddr, sync::Arc};

use aya::maps::{Array, HashMap, MapData, RingBuf};
use dataplane_common::{
    FAST_SERVICE_MAX_ENDPOINTS, FastConn, FastEndpoint, FastKey, FastService, FastVerdict,
    SockTuple,
    maps::{FAST_BY_TUPLE, FAST_CLOSED, FAST_GENERATION, FAST_SERVICES, FAST_VERDICTS},
};

use super::{
    PinLayout, RedirectError,
    kernel_maps::{collect_keys, ignore_missing},
    keys::addr16,
    stats::open_pinned,
};

/// The verdict cache, its generation and the open-connection records.
pub struct FastPathTable {
    verdicts: HashMap<MapData, FastKey, FastVerdict>,
    services: HashMap<MapData, FastKey, FastService>,
    generation_map: Array<MapData, u64>,
    open: HashMap<MapData, SockTuple, FastConn>,
    generation: u64,
    /// Every verdict this agent cached (the kernel adds none), with the
    /// endpoints of a service's: a revocation finds the ones a change
    /// concerns here, without walking the kernel's maps (a walk visits
    /// every bucket, whatever the map holds).
    cached: StdHashMap<Cached, Arc<[SocketAddr]>>,
}

/// A verdict the agent cached: connections from the pod of namespace
/// `src_netns` to `dst`, a workload's own address or (`service`) a VIP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cached {
    /// The client pod's network namespace cookie.
    pub src_netns: u64,
    /// The destination as the client dials it.
    pub dst: SocketAddr,
    /// Whether `dst` is a service VIP.
    pub service: bool,
}

impl std::fmt::Debug for FastPathTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastPathTable")
            .field("generation", &self.generation)
            .finish()
    }
}

impl FastPathTable {
    /// Opens the pinned maps of the instance laid out by `pins`, and voids
    /// every verdict a previous agent left (its configuration may not be
    /// this one's).
    pub fn open(pins: &PinLayout) -> Result<Self, RedirectError> {
        let generation_map: Array<MapData, u64> = open_pinned(pins, FAST_GENERATION)?;
        let generation = generation_map
            .get(&0, 0)
            .map_err(|source| RedirectError::Map {
                name: FAST_GENERATION,
                source,
            })?;
        let mut table = Self {
            verdicts: open_pinned(pins, FAST_VERDICTS)?,
            services: open_pinned(pins, FAST_SERVICES)?,
            generation_map,
            open: open_pinned(pins, FAST_BY_TUPLE)?,
            generation,
            cached: StdHashMap::new(),
        };
        table.revoke_all()?;
        // A previous agent's verdicts are not in `cached`: remove them by
        // walking the maps, once.
        let keys = collect_keys(table.verdicts.keys(), FAST_VERDICTS)?;
        for key in keys {
            ignore_missing(table.verdicts.remove(&key), FAST_VERDICTS)?;
        }
        let keys = collect_keys(table.services.keys(), FAST_SERVICES)?;
        for key in keys {
            ignore_missing(table.services.remove(&key), FAST_SERVICES)?;
        }
        Ok(table)
    }

    /// The ring buffer of closed fast-path connections of the instance.
    pub fn closed_records(pins: &PinLayout) -> Result<RingBuf<MapData>, RedirectError> {
        open_pinned(pins, FAST_CLOSED)
    }

    /// Caches "allowed" for connections from the pod of namespace
    /// `src_netns` to `dst`, while `dst`'s address belongs to the pod of
    /// namespace `dst_netns`.
    pub fn allow(
        &mut self,
        src_netns: u64,
        dst: SocketAddr,
        dst_netns: u64,
    ) -> Result<(), RedirectError> {
        let key = fast_key(src_netns, dst);
        let verdict = FastVerdict {
            dst_netns_cookie: dst_netns,
            generation: self.generation,
        };
        self.verdicts
            .insert(key, verdict, 0)
            .map_err(|source| RedirectError::Map {
                name: FAST_VERDICTS,
                source,
            })?;
        let cached = Cached {
            src_netns,
            dst,
            service: false,
        };
        self.cached.insert(cached, Arc::from([]));
        Ok(())
    }

    /// Caches "allowed" for connections from the pod of namespace
    /// `src_netns` to the service VIP and port `vip`: `endpoints` are its
    /// endpoints on this node (address, and namespace of the pod that owns
    /// it; at most [`FAST_SERVICE_MAX_ENDPOINTS`], which the caller
    /// checks), `choices` how many it has in all.
    pub fn allow_service(
        &mut self,
        src_netns: u64,
        vip: SocketAddr,
        endpoints: &[(SocketAddr, u64)],
        choices: usize,
    ) -> Result<(), RedirectError> {
        let mut service = FastService {
            generation: self.generation,
            ..FastService::default()
        };
        for (slot, (addr, netns)) in service.endpoints.iter_mut().zip(endpoints) {
            *slot = FastEndpoint {
                addr: addr16(addr.ip()),
                dst_netns_cookie: *netns,
                port: addr.port(),
                _pad: [0; 6],
            };
        }
        // Never more than the slots: `zip` stopped there too.
        service.count = endpoints.len().min(FAST_SERVICE_MAX_ENDPOINTS) as u32;
        service.choices = u32::try_from(choices)
            .unwrap_or(u32::MAX)
            .max(service.count);
        self.services
            .insert(fast_key(src_netns, vip), service, 0)
            .map_err(|source| RedirectError::Map {
                name: FAST_SERVICES,
                source,
            })?;
        let cached = Cached {
            src_netns,
            dst: vip,
            service: true,
        };
        let endpoints = endpoints.iter().map(|(addr, _)| *addr).collect();
        self.cached.insert(cached, endpoints);
        Ok(())
    }

    /// Voids every cached verdict at once (one write of the generation the
    /// kernel compares against), then clears the cache. Connections already
    /// open are not touched here: see [`Self::open_connections`].
    pub fn revoke_all(&mut self) -> Result<(), RedirectError> {
        let next = self.generation.wrapping_add(1);
        self.generation_map
            .set(0, next, 0)
            .map_err(|source| RedirectError::Map {
                name: FAST_GENERATION,
                source,
            })?;
        self.generation = next;
        self.revoke_where(|_, _| true).map(drop)
    }

    /// Removes the cached verdicts `void` picks (given each verdict and,
    /// for a service, the endpoints it carries to); returns them. The
    /// others stay valid.
    pub fn revoke_where(
        &mut self,
        void: impl Fn(&Cached, &[SocketAddr]) -> bool,
    ) -> Result<Vec<Cached>, RedirectError> {
        let voided: Vec<Cached> = self
            .cached
            .iter()
            .filter(|(cached, endpoints)| void(cached, endpoints))
            .map(|(cached, _)| *cached)
            .collect();
        for cached in &voided {
            let key = fast_key(cached.src_netns, cached.dst);
            if cached.service {
                ignore_missing(self.services.remove(&key), FAST_SERVICES)?;
            } else {
                ignore_missing(self.verdicts.remove(&key), FAST_VERDICTS)?;
            }
            self.cached.remove(cached);
        }
        Ok(voided)
    }

    /// Every open fast-path connection: its tuple (client side first) and
    /// the two pods' namespaces.
    pub fn open_connections(&self) -> Result<Vec<(SockTuple, FastConn)>, RedirectError> {
        self.open
            .iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| RedirectError::Map {
                name: FAST_BY_TUPLE,
                source,
            })
    }
}

/// The cache key of connections from the pod of namespace `src_netns` to
/// `dst`.
fn fast_key(src_netns: u64, dst: SocketAddr) -> FastKey {
    FastKey {
        netns_cookie: src_netns,
        dst_addr: addr16(dst.ip()),
        dst_port: dst.port(),
        _pad: [0; 6],
    }
}
