//! How a connection ended, in our words ([`FailReason`], the `reason`
//! label of `dataplane_tcp_connections_failed_total`) and in Istio's
//! ([`ResponseFlags`], the `response_flags` label of `istio_tcp_*` and the
//! access record's field).

/// Istio's node proxy's `response_flags` vocabulary (ztunnel
/// `src/proxy/metrics.rs`, `ResponseFlags` and its label encoding). A
/// connection with any flag but [`ResponseFlags::None`] counts in
/// `istio_tcp_connections_failed_total`, as ztunnel's
/// `ConnectionResult::record_internal` counts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum ResponseFlags {
    /// `-`: nothing to say (the connection went through, or it was refused
    /// before Istio's node proxy would have counted it).
    #[default]
    None,
    /// `DENY`: an authorization policy denied the connection, at its start
    /// or later (a policy change closed it).
    Deny,
    /// `CONNECT`: the destination, its node or its app could not be
    /// reached, or the connection failed after it was set up (ztunnel's
    /// flag for any error it has no better flag for, drain included).
    Connect,
    /// `TLS_FAILURE`: a TLS handshake failed.
    TlsFailure,
    /// `H2_HANDSHAKE_FAILURE`: HTTP/2 with the HBONE peer failed.
    Http2HandshakeFailure,
    /// `NETWORK_POLICY`: the HBONE peer's port did not answer in time, as
    /// when a Kubernetes NetworkPolicy drops what reaches it (ztunnel
    /// `src/proxy/pool.rs`, `ConnSpawner::new_pool_conn`: a timed-out
    /// connect is `MaybeHBONENetworkPolicyError`).
    NetworkPolicy,
    /// `IDENTITY_ERROR`: the local workload's certificate could not be had.
    /// Not set yet: without a certificate the handshake goes on with none
    /// and the peer refuses it (`CONNECT`).
    IdentityError,
    /// `CERT_REVOKED`: a peer certificate was revoked by a CRL. Not set:
    /// certificate revocation lists are not read yet.
    CertRevoked,
    /// `REGISTRY_ONLY`: ours, not ztunnel's (which has no such mode): the
    /// destination is not in the mesh's registry and the mesh's outbound
    /// traffic policy is `REGISTRY_ONLY`. None of ztunnel's flags says
    /// this: `DENY` reads as an authorization policy, `CONNECT` as an
    /// unreachable destination, though nothing was dialled.
    RegistryOnly,
}

impl ResponseFlags {
    /// The label value, as ztunnel writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "-",
            Self::Deny => "DENY",
            Self::Connect => "CONNECT",
            Self::TlsFailure => "TLS_FAILURE",
            Self::Http2HandshakeFailure => "H2_HANDSHAKE_FAILURE",
            Self::NetworkPolicy => "NETWORK_POLICY",
            Self::IdentityError => "IDENTITY_ERROR",
            Self::CertRevoked => "CERT_REVOKED",
            Self::RegistryOnly => "REGISTRY_ONLY",
        }
    }

    /// Whether a connection with this flag failed (counts in
    /// `istio_tcp_connections_failed_total`).
    pub fn is_failure(self) -> bool {
        self != Self::None
    }
}

/// Why a connection could not be set up: the `reason` label of
/// `dataplane_tcp_connections_failed_total` (the access record has the
/// details).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailReason {
    /// No kernel or netfilter record of where an outbound connection went.
    NoOriginalDestination,
    /// The destination is one of the engine's own ports (would loop).
    EnginePort,
    /// An authorization policy denied it.
    Denied,
    /// The destination refused or could not be reached.
    ConnectFailed,
    /// The destination did not answer in time.
    ConnectTimeout,
    /// A service without (reachable) endpoints.
    NoEndpoints,
    /// The DNS name of the endpoints reached by name did not resolve
    /// (ztunnel `NoResolvedAddresses`, `EmptyResolvedAddresses`).
    DnsFailed,
    /// The HBONE tunnel could not be opened (TLS, a refused CONNECT, a
    /// refused or reset TCP connection to the peer).
    Tunnel,
    /// The HBONE peer's port did not answer (TCP and TLS) in time.
    TunnelTimeout,
    /// HTTP/2 with the HBONE peer failed (its handshake, or the stream).
    TunnelHttp2,
    /// An inbound TLS handshake failed.
    TlsHandshake,
    /// An inbound HBONE connection did not finish its TLS handshake, HTTP/2
    /// preface and first SETTINGS in time.
    HandshakeTimeout,
    /// A malformed or disallowed CONNECT request.
    BadRequest,
    /// The app behind an inbound tunnel could not be reached.
    AppUnreachable,
    /// The client's connection failed (was reset) before it was relayed.
    ClientFailed,
    /// The pod this agent serves is unknown to the control plane.
    UnknownWorkload,
    /// The destination is not in the mesh's registry and the outbound
    /// traffic policy is `REGISTRY_ONLY`.
    RegistryOnly,
    /// Anything else (a socket could not be created, ...).
    Internal,
}

impl FailReason {
    /// Istio's `response_flags` for it, set where ztunnel sets them
    /// (`src/proxy/inbound.rs` `serve_connect`: `DENY` for a policy,
    /// `CONNECT` for an unreachable app; `src/proxy/metrics.rs`
    /// `ConnectionResult::extract_failure_reason` for the rest, `CONNECT`
    /// by default). `-` where ztunnel only logs an early denial
    /// (`metrics::log_early_deny`: a call to its own ports, an unknown
    /// local workload, a malformed CONNECT, a slow handshake): such
    /// connections are not counted in Istio's families.
    pub fn response_flags(self) -> ResponseFlags {
        match self {
            Self::Denied => ResponseFlags::Deny,
            Self::ConnectFailed
            | Self::ConnectTimeout
            | Self::NoEndpoints
            | Self::DnsFailed
            | Self::Tunnel
            | Self::AppUnreachable
            | Self::ClientFailed
            | Self::Internal => ResponseFlags::Connect,
            Self::TunnelTimeout => ResponseFlags::NetworkPolicy,
            Self::TunnelHttp2 => ResponseFlags::Http2HandshakeFailure,
            Self::TlsHandshake => ResponseFlags::TlsFailure,
            // Counted in Istio's families, as a sidecar's BlackHoleCluster
            // connections are, so dashboards show the refused egress.
            Self::RegistryOnly => ResponseFlags::RegistryOnly,
            Self::NoOriginalDestination
            | Self::EnginePort
            | Self::UnknownWorkload
            | Self::BadRequest
            | Self::HandshakeTimeout => ResponseFlags::None,
        }
    }

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoOriginalDestination => "no_original_destination",
            Self::EnginePort => "engine_port",
            Self::Denied => "denied",
            Self::ConnectFailed => "connect_failed",
            Self::ConnectTimeout => "connect_timeout",
            Self::NoEndpoints => "no_endpoints",
            Self::DnsFailed => "dns_failed",
            Self::Tunnel => "tunnel_failed",
            Self::TunnelTimeout => "tunnel_timeout",
            Self::TunnelHttp2 => "tunnel_http2",
            Self::TlsHandshake => "tls_handshake",
            Self::HandshakeTimeout => "handshake_timeout",
            Self::BadRequest => "bad_request",
            Self::AppUnreachable => "app_unreachable",
            Self::ClientFailed => "client_failed",
            Self::UnknownWorkload => "unknown_workload",
            Self::RegistryOnly => "registry_only",
            Self::Internal => "internal",
        }
    }
}
