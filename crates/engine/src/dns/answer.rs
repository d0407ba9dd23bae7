//! Answers from the mesh: A and AAAA queries for a service hostname the
//! mesh knows get its addresses; everything else is the upstream
//! servers' to answer.
//!
//! Semantics follow Istio's node proxy: a known name without an address of
//! the asked family is NOERROR with no records (NODATA), never NXDOMAIN;
//! unknown names, and other record types, are forwarded.

use std::net::IpAddr;

use hickory_proto::{
    op::{Edns, Message, MessageType, OpCode, ResponseCode},
    rr::{
        Name, RData, Record, RecordType,
        rdata::{A, AAAA, CNAME},
    },
};

use super::names::{candidates, normalize, wildcards};

/// TTL of mesh answers, in seconds (the mesh state can change at any time).
pub const MESH_TTL: u32 = 30;
/// The UDP payload size this resolver advertises in EDNS.
pub const EDNS_PAYLOAD: u16 = 1232;

/// What to do with one parsed query.
#[derive(Debug)]
pub enum Decision {
    /// Answer with this message (from the mesh).
    Answer(MeshAnswer),
    /// Ask the upstream servers.
    Forward,
}

/// A mesh answer and how it is counted.
#[derive(Debug)]
pub struct MeshAnswer {
    /// The response.
    pub message: Message,
    /// `true`: records were found; `false`: NODATA (name known, family not).
    pub has_records: bool,
}

/// Decides how to answer `request` from a pod of `namespace` in the
/// cluster domain `domain`. `addresses` gives a mesh hostname's addresses
/// (`None`: the mesh does not know the name). Without `ipv6`
/// (`--ipv6-enabled false`) a mesh name has no AAAA record, as ztunnel
/// answers without `IPV6_ENABLED` (`src/dns/server.rs`
/// `service_family_allowed`): an app would dial an address nothing on the
/// node serves.
pub fn decide(
    request: &Message,
    namespace: &str,
    domain: &str,
    ipv6: bool,
    addresses: impl Fn(&str) -> Option<Vec<IpAddr>>,
) -> Decision {
    if request.metadata.message_type != MessageType::Query
        || request.metadata.op_code != OpCode::Query
        || request.queries.len() != 1
    {
        return Decision::Forward;
    }
    let query = &request.queries[0];
    let qtype = query.query_type();
    if qtype != RecordType::A && qtype != RecordType::AAAA {
        return Decision::Forward;
    }
    let asked = normalize(&query.name().to_ascii());
    // Each candidate as it is, then under the wildcards above it (a
    // ServiceEntry for `*.example.com`), as ztunnel's `find_server`.
    let Some((candidate, wildcard, addrs)) = candidates(&asked, namespace, domain)
        .into_iter()
        .find_map(|c| {
            let found = wildcards(&c.hostname)
                .enumerate()
                .find_map(|(i, name)| addresses(&name).map(|a| (i > 0, a)));
            found.map(|(wildcard, a)| (c, wildcard, a))
        })
    else {
        return Decision::Forward;
    };
    let mut message = reply_to(request, ResponseCode::NoError);
    message.metadata.authoritative = true;
    let mut owner = query.name().clone();
    // A wildcard answers for the name asked, without a CNAME (ztunnel
    // `lookup`: no CNAME when the match is a wildcard).
    if let Some(stripped) = candidate.stripped.as_deref()
        && !wildcard
        && let Ok(target) = Name::from_ascii(format!("{stripped}."))
    {
        message.answers.push(Record::from_rdata(
            owner.clone(),
            MESH_TTL,
            RData::CNAME(CNAME(target.clone())),
        ));
        owner = target;
    }
    let mut has_records = false;
    for addr in addrs {
        let data = match (qtype, addr.to_canonical()) {
            (RecordType::A, IpAddr::V4(v4)) => RData::A(A(v4)),
            (RecordType::AAAA, IpAddr::V6(v6)) if ipv6 => RData::AAAA(AAAA(v6)),
            _ => continue,
        };
        message
            .answers
            .push(Record::from_rdata(owner.clone(), MESH_TTL, data));
        has_records = true;
    }
    if !has_records {
        // NODATA: the name exists, without an address of this family.
        message.answers.clear();
    }
    Decision::Answer(MeshAnswer {
        message,
        has_records,
    })
}

/// An empty response to `request` with `code`: same id, question and
/// recursion-desired bit, recursion available, and an OPT record when the
/// request carried one.
pub fn reply_to(request: &Message, code: ResponseCode) -> Message {
    let mut message = Message::new(
        request.metadata.id,
        MessageType::Response,
        request.metadata.op_code,
    );
    message.metadata.recursion_desired = request.metadata.recursion_desired;
    message.metadata.recursion_available = true;
    message.metadata.checking_disabled = request.metadata.checking_disabled;
    message.metadata.response_code = code;
    message.queries = request.queries.clone();
    if request.edns.is_some() {
        let mut edns = Edns::new();
        edns.set_max_payload(EDNS_PAYLOAD);
        message.edns = Some(edns);
    }
    message
}

/// The largest response `request`'s sender takes over UDP: 512 bytes, or
/// its EDNS payload size (at most `cap`).
pub fn udp_limit(request: &Message, cap: usize) -> usize {
    let advertised = request
        .edns
        .as_ref()
        .map_or(512, |edns| usize::from(edns.max_payload()).max(512));
    advertised.min(cap)
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test inputs are fixed")]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use hickory_proto::op::Query;

    use super::*;

    const V4: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10));
    const V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 10));

    fn query(name: &str, qtype: RecordType) -> Message {
        let mut m = Message::new(7, MessageType::Query, OpCode::Query);
        m.metadata.recursion_desired = true;
        m.queries
            .push(Query::query(Name::from_ascii(name).unwrap(), qtype));
        m
    }

    fn mesh(host: &str) -> Option<Vec<IpAddr>> {
        match host {
            "echo.shop.svc.cluster.local" => Some(vec![V4, V6]),
            "v4only.shop.svc.cluster.local" => Some(vec![V4]),
            _ => None,
        }
    }

    fn answer(name: &str, qtype: RecordType) -> Option<MeshAnswer> {
        answer_with(name, qtype, true)
    }

    fn answer_with(name: &str, qtype: RecordType, ipv6: bool) -> Option<MeshAnswer> {
        match decide(&query(name, qtype), "shop", "cluster.local", ipv6, mesh) {
            Decision::Answer(a) => Some(a),
            Decision::Forward => None,
        }
    }

    #[test]
    fn a_mesh_name_gets_its_vip_per_family() {
        let a = answer("echo.shop.svc.cluster.local.", RecordType::A).unwrap();
        assert_eq!(a.message.metadata.id, 7);
        assert!(a.message.metadata.authoritative);
        assert_eq!(a.message.answers.len(), 1);
        assert_eq!(
            a.message.answers[0].data,
            RData::A(A(Ipv4Addr::new(10, 96, 0, 10)))
        );
        let aaaa = answer("echo.shop.svc.cluster.local.", RecordType::AAAA).unwrap();
        assert!(matches!(aaaa.message.answers[0].data, RData::AAAA(_)));
    }

    #[test]
    fn with_ipv6_off_a_mesh_name_has_no_aaaa_record() {
        let aaaa = answer_with("echo.shop.svc.cluster.local.", RecordType::AAAA, false).unwrap();
        assert!(!aaaa.has_records);
        assert_eq!(aaaa.message.metadata.response_code, ResponseCode::NoError);
        assert!(aaaa.message.answers.is_empty());
        let a = answer_with("echo.shop.svc.cluster.local.", RecordType::A, false).unwrap();
        assert!(a.has_records);
    }

    #[test]
    fn a_known_name_without_the_family_is_nodata_not_nxdomain() {
        let a = answer("v4only.shop.svc.cluster.local.", RecordType::AAAA).unwrap();
        assert!(!a.has_records);
        assert_eq!(a.message.metadata.response_code, ResponseCode::NoError);
        assert!(a.message.answers.is_empty());
    }

    #[test]
    fn short_names_and_stripped_search_domains_answer() {
        let a = answer("echo.", RecordType::A).unwrap();
        assert_eq!(a.message.answers[0].name.to_ascii(), "echo.");
        let a = answer("echo.svc.cluster.local.", RecordType::A).unwrap();
        assert!(matches!(a.message.answers[0].data, RData::CNAME(_)));
        assert_eq!(a.message.answers.len(), 2);
    }

    #[test]
    fn unknown_names_and_other_types_are_forwarded() {
        assert!(answer("example.com.", RecordType::A).is_none());
        assert!(answer("echo.shop.svc.cluster.local.", RecordType::TXT).is_none());
        assert!(answer("echo.other.svc.cluster.local.", RecordType::A).is_none());
    }

    #[test]
    fn udp_limit_follows_edns() {
        let mut q = query("echo.", RecordType::A);
        assert_eq!(udp_limit(&q, 4096), 512);
        let mut edns = Edns::new();
        edns.set_max_payload(1232);
        q.edns = Some(edns);
        assert_eq!(udp_limit(&q, 4096), 1232);
    }
}
