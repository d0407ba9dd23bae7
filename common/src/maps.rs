//! Names of the maps and programs in the kernel object, shared so that the
//! agent never spells one differently from the kernel crate.
//!
//! Object names are limited to 15 bytes by the kernel (`BPF_OBJ_NAME_LEN`);
//! pinned file names carry the longer, self-explaining form (see the agent's
//! `redirect::pins` module).

/// `HashMap<u64 netns cookie, EnrolledNetns>`: network namespaces in the mesh.
pub const ENROLLED_NETNS: &str = "ENROLLED_NETNS";
/// `LruHashMap<u64 socket cookie, CapturedDst>`: original destination of a
/// captured client socket and its namespace, for `sockops` (to re-key it by
/// tuple) and for `getpeername` (for the socket's lifetime, until LRU
/// eviction).
pub const ORIG_DST_COOKIE: &str = "ORIG_DST_COOKIE";
/// `LruHashMap<OrigDstKey, OrigDst>`: original destination by namespace and
/// connection tuple, read by the engine when it accepts a captured
/// connection and by `getsockopt(SO_ORIGINAL_DST)`.
pub const ORIG_DST: &str = "ORIG_DST";
/// `Array<AgentConfig>` with one slot.
pub const AGENT_CONFIG: &str = "AGENT_CONFIG";
/// `PerCpuArray<u64>` indexed by [`crate::Counter`].
pub const REDIRECT_STATS: &str = "REDIRECT_STATS";
/// `HashMap<NetnsPort, u8>`: outbound destination ports a pod excludes.
pub const OUT_EXCL_PORTS: &str = "OUT_EXCL_PORTS";
/// `LpmTrie<NetnsAddr, u8>`: outbound destination CIDRs a pod excludes.
pub const OUT_EXCL_CIDRS: &str = "OUT_EXCL_CIDRS";
/// `HashMap<IpAddr16 pod IP, PodInbound>`: enrolled pods by IP, for
/// `sk_lookup`.
pub const POD_INBOUND: &str = "POD_INBOUND";
/// `HashMap<u64 netns cookie, PodSource>`: the source addresses of the
/// captured outbound connections of pods served by an external proxy.
pub const POD_SOURCE: &str = "POD_SOURCE";
/// `HashMap<PodPort, u8>`: inbound ports a pod excludes.
pub const IN_EXCL_PORTS: &str = "IN_EXCL_PORTS";
/// `HashMap<IpAddr16, u8>`: source addresses whose inbound connections are
/// never captured (kubelet probe addresses such as 169.254.7.127).
pub const PROBE_SOURCES: &str = "PROBE_SOURCES";
/// `SockHash<ListenerKey>`: the engine's in-pod inbound (15006) and HBONE
/// (15008) listeners, by pod IP and role port.
pub const LISTENERS: &str = "LISTENERS";

/// `LruHashMap<u64 socket cookie, DnsOrigDst>`: the DNS server a pod's
/// socket asked before `connect`/`sendmsg` steered it to the in-pod
/// resolver, for `recvmsg` and `getpeername` (until LRU eviction).
pub const DNS_ORIG_COOKIE: &str = "DNS_ORIG_COOKIE";
/// Capacity of [`DNS_ORIG_COOKIE`]: sockets with DNS in flight per node.
pub const DNS_ORIG_CAPACITY: u32 = 16_384;

/// `LruHashMap<SockTuple, u8>`: connections the engine is opening to an
/// app from the client's own address (transparent sockets, original
/// source), recorded by the engine between `bind()` and `connect()` (for
/// an external in-pod proxy: by [`PROG_PROXY_SYN`] as the SYN crosses the
/// pod's `lo`) and consumed by `sk_lookup`, which lets exactly those SYNs
/// reach the app instead of capturing them.
pub const TPROXY_TUPLES: &str = "TPROXY_TUPLES";

/// Capacity of [`TPROXY_TUPLES`]: transparent connections being opened at
/// once; an entry lives from `connect()` to the SYN's arrival.
pub const TPROXY_CAPACITY: u32 = 16_384;

/// `Array<u64>` with one slot: the cookie of the node's own network
/// namespace (the agent's), written by the agent. 0: none known.
pub const NODE_NETNS: &str = "NODE_NETNS";
/// `LruHashMap<u64 socket cookie, u8>`: sockets of the node's own
/// namespace (kubelet's probes among them) that `connect()`ed to an
/// enrolled pod's IP, from `connect` to `sockops`' connect callback, which
/// moves them to [`NODE_TUPLES`] once the source port is known.
pub const NODE_CONNECTS: &str = "NODE_CONNECTS";
/// `LruHashMap<SockTuple, u8>`: connections from the node's own namespace
/// to enrolled pods, consumed by the pod's `sk_lookup`, which lets exactly
/// those SYNs reach the app uncaptured (what istio-cni's SNAT to
/// 169.254.7.127 and its in-pod rule for that source do). Traffic merely
/// forwarded through the node (kube-proxy) has no socket there, so it is
/// never in it.
pub const NODE_TUPLES: &str = "NODE_TUPLES";
/// Capacity of [`NODE_CONNECTS`] and [`NODE_TUPLES`]: node connections to
/// pods being opened at once.
pub const NODE_CONNECT_CAPACITY: u32 = 8_192;

/// Capacity of [`ORIG_DST`] and [`ORIG_DST_COOKIE`]: concurrent captured
/// connections the node tracks before the oldest records are evicted.
pub const ORIG_DST_CAPACITY: u32 = 65_536;
/// Capacity of [`ENROLLED_NETNS`]: pods per node.
pub const ENROLLED_CAPACITY: u32 = 4_096;
/// Capacity of [`POD_INBOUND`]: two IPs per pod.
pub const POD_IP_CAPACITY: u32 = 2 * ENROLLED_CAPACITY;
/// Capacity of [`LISTENERS`]: two roles (inbound, HBONE) per pod IP.
pub const LISTENERS_CAPACITY: u32 = 2 * POD_IP_CAPACITY;
/// Capacity of the exclusion maps.
pub const EXCLUSION_CAPACITY: u32 = 16_384;
/// Capacity of [`PROBE_SOURCES`].
pub const PROBE_SOURCES_CAPACITY: u32 = 64;

/// `LruHashMap<FastKey, FastVerdict>`: (client pod, destination) pairs the
/// agent allowed onto the same-node fast path.
pub const FAST_VERDICTS: &str = "FAST_VERDICTS";
/// `Array<u64>` with one slot: the current verdict generation. The agent
/// bumps it to void every cached verdict at once.
pub const FAST_GENERATION: &str = "FAST_GENERATION";
/// `LruHashMap<u64 socket cookie, FastConn>`: fast-path client sockets
/// between `connect()` and close.
pub const FAST_BY_COOKIE: &str = "FAST_BY_COOKIE";
/// `LruHashMap<SockTuple, FastConn>`: open fast-path connections by tuple
/// (client side first), for `sk_lookup` and for the agent's re-check when
/// policies change.
pub const FAST_BY_TUPLE: &str = "FAST_BY_TUPLE";
/// `RingBuf` of `FastClose` records (`FastCloseVip` for connections to a
/// service VIP).
pub const FAST_CLOSED: &str = "FAST_CLOSED";
/// `LruHashMap<FastKey, FastService>`: (client pod, service VIP and port)
/// pairs the agent allowed onto the fast path, with the endpoints to
/// choose from.
pub const FAST_SERVICES: &str = "FAST_SERVICES";
/// `LruHashMap<u64 socket cookie, FastVip>`: the VIP each fast-path client
/// socket to a service dialled, from `connect()` to close.
pub const FAST_VIP_BY_COOKIE: &str = "FAST_VIP_BY_COOKIE";
/// Capacity of [`FAST_SERVICES`] (about 300 bytes an entry).
pub const FAST_SERVICE_CAPACITY: u32 = 8_192;
/// Capacity of the verdict cache.
pub const FAST_VERDICT_CAPACITY: u32 = 65_536;
/// Capacity of the open fast-path connection records.
pub const FAST_CONN_CAPACITY: u32 = 65_536;
/// Size of the close-record ring buffer in bytes (a power of two, a
/// multiple of the page size): 3,276 records of 80 bytes plus headers
/// (2,520 of the 104-byte records of connections to a service VIP).
pub const FAST_CLOSED_BYTES: u32 = 256 * 1024;
/// Bytes of close records waiting in the ring at which a new record wakes
/// the agent (about 200 records); fewer wait for its periodic drain. A
/// wake-up per closed connection, thousands a second, costs the agent more
/// than reporting the connections does.
pub const FAST_CLOSED_WAKE_BYTES: u64 = 16 * 1024;

/// `cgroup/connect4`: rewrites enrolled pods' outbound IPv4 TCP connections
/// to the outbound listener.
pub const PROG_CONNECT4: &str = "dp_connect4";
/// `cgroup/connect6`: the same for IPv6 sockets, IPv4-mapped included.
pub const PROG_CONNECT6: &str = "dp_connect6";
/// `sockops`: at TCP connect time, re-keys the original destination from
/// the socket cookie to the namespace and connection tuple.
pub const PROG_SOCKOPS: &str = "dp_sockops";
/// `cgroup/getsockopt`: answers `SO_ORIGINAL_DST` (v4 and v6) from the
/// record under the socket's namespace (5.15).
pub const PROG_GETSOCKOPT: &str = "dp_getsockopt";
/// `cgroup/getsockopt` before 5.15: answers from the records keyed by
/// tuple alone (namespace 0), those of pods served by external proxies.
pub const PROG_GETSOCKOPT_BY_TUPLE: &str = "dp_gsopt_tuple";
/// `cgroup/getpeername4`: apps see the peer they dialled.
pub const PROG_GETPEERNAME4: &str = "dp_getpeername4";
/// `cgroup/getpeername6`: the same for IPv6 sockets.
pub const PROG_GETPEERNAME6: &str = "dp_getpeername6";
/// `cgroup/sendmsg4`: enrolled pods' unconnected UDP DNS queries go to the
/// in-pod resolver.
pub const PROG_DNS_SENDMSG4: &str = "dp_dns_sendmsg4";
/// `cgroup/sendmsg6`: the same for IPv6 sockets.
pub const PROG_DNS_SENDMSG6: &str = "dp_dns_sendmsg6";
/// `cgroup/recvmsg4`: the resolver's replies show the server the app asked.
pub const PROG_DNS_RECVMSG4: &str = "dp_dns_recvmsg4";
/// `cgroup/recvmsg6`: the same for IPv6 sockets.
pub const PROG_DNS_RECVMSG6: &str = "dp_dns_recvmsg6";
/// `sk_lookup`, one link per enrolled pod network namespace: inbound TCP to
/// the pod's IPs goes to the engine's listeners.
pub const PROG_SK_LOOKUP: &str = "dp_sk_lookup";

/// `classifier` (tc), attached to ingress of `lo` in the network namespace
/// of each pod served by an external in-pod proxy (Istio's ztunnel): the
/// proxy's SYNs to the pod's apps are recorded in [`TPROXY_TUPLES`] and
/// take the transparent mark.
pub const PROG_PROXY_SYN: &str = "dp_proxy_syn";

/// `LruHashMap<u64 socket cookie, u64 netns cookie>` of the netns-cookie
/// probe object (kernels without `SO_NETNS_COOKIE`, before 5.14): filled by
/// [`PROG_NETNS_COOKIE`] for the agent's probe connections. Not pinned: the
/// probe lives and dies with the agent process.
pub const NETNS_COOKIES: &str = "NETNS_COOKIES";
/// Capacity of [`NETNS_COOKIES`]: look-ups in flight at once, at most.
pub const NETNS_COOKIES_CAPACITY: u32 = 256;
/// `cgroup/connect4` in the probe object, attached to the agent's own
/// cgroup: records `socket cookie -> netns cookie` for a `connect()` to
/// [`NETNS_COOKIE_PROBE_ADDR`]:[`NETNS_COOKIE_PROBE_PORT`].
pub const PROG_NETNS_COOKIE: &str = "dp_netns_cookie";
/// Destination of the probe connection, `127.0.0.1` as a host-order number:
/// a UDP `connect()` to it sends nothing.
pub const NETNS_COOKIE_PROBE_ADDR: u32 = 0x7f00_0001;
/// Destination port of the probe connection: discard, where nothing listens
/// (and nothing is sent anyway).
pub const NETNS_COOKIE_PROBE_PORT: u16 = 9;
