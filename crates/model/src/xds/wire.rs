//! A delta response read where it lies: the gRPC message's bytes are
//! kept as received and each resource is read from them when it is
//! applied, so a response is never held twice.
//!
//! Decoded by prost, a response becomes a second copy of itself: each
//! resource's name, version, type URL and body in their own allocations
//! (four a resource, plus a 100-byte `Resource` in a vector), beside the
//! message buffer that has not been freed yet. istiod sends a proxy's
//! whole first state in one response (about 245 bytes a workload), so at
//! a million workloads that copy was ~400 MB and four million
//! allocations on top of the ~245 MB message. Here a response is the
//! message ([`Bytes`], as the call's framing cut it, not copied:
//! [`super::grpc`]) and an 8-byte span per resource; [`Response::resources`] reads each
//! one as it is needed.
//!
//! The framing is checked when the message arrives, as deep as prost's
//! decoding of [`DeltaDiscoveryResponse`] checks it (the response, each
//! `Resource` and its `Any`; strings must be UTF-8; unknown fields are
//! skipped), so a message prost would refuse is refused here too, and
//! reading a resource later cannot fail. A resource body (the `Workload`
//! or `Authorization` inside the `Any`) is decoded by whoever applies it.

use bytes::Bytes;

use crate::istio_api::discovery::DeltaDiscoveryResponse;

/// Deepest nesting of groups skipped in unknown fields (prost's recursion
/// limit).
const MAX_DEPTH: u32 = 100;

/// Why a message is not a valid `DeltaDiscoveryResponse`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The bytes end inside a field, or a length runs past its message.
    #[error("truncated message at byte {at}: {what}")]
    Truncated {
        /// Offset in the response where the field starts.
        at: usize,
        /// What was being read.
        what: &'static str,
    },
    /// A field's encoding is not valid protobuf.
    #[error("invalid protobuf at byte {at}: {what}")]
    Invalid {
        /// Offset in the response where the field starts.
        at: usize,
        /// What is wrong.
        what: &'static str,
    },
    /// A string field is not UTF-8.
    #[error("field {field} at byte {at} is not UTF-8")]
    NotUtf8 {
        /// Offset in the response where the string starts.
        at: usize,
        /// The field, e.g. `Resource.name`.
        field: &'static str,
    },
    /// The message is larger than spans can address (4 GiB).
    #[error("message of {0} bytes is too large")]
    TooLarge(usize),
    /// The message holds more resources and removed names than its size
    /// allows for ([`MAX_SPAN_BYTES_PER_BYTE`]); prost would read it, into
    /// memory several times its size.
    #[error(
        "message of {len} bytes names over {max} resources and removals; \
         real ones average far more bytes each"
    )]
    TooManyEntries {
        /// The message's length.
        len: usize,
        /// The most entries a message of that length may name.
        max: usize,
    },
}

/// The spans a response keeps may take at most its own size (or, for a
/// small one, [`MIN_SPAN_ALLOWANCE`]): a resource or removed name
/// needs 2 bytes on the wire at least (an empty one), but 8 as a span,
/// so without a bound a 512 MiB message of empty entries would cost 2 GiB
/// of spans. Real entries are far larger (a removed name is a uid or
/// `namespace/hostname`; a resource carries a name, a version and an
/// `Any` with a 40-odd-byte type URL), so no response istiod sends comes
/// near it.
const MAX_SPAN_BYTES_PER_BYTE: usize = 1;
/// The span bytes any response may use, however small.
const MIN_SPAN_ALLOWANCE: usize = 64 * 1024;

/// Where a field's bytes lie in the message.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Span {
    start: u32,
    end: u32,
}

impl Span {
    fn of(self, buf: &[u8]) -> &[u8] {
        buf.get(self.start as usize..self.end as usize)
            .unwrap_or_default()
    }

    fn str(self, buf: &[u8]) -> &str {
        // Checked to be UTF-8 when the message was read.
        std::str::from_utf8(self.of(buf)).unwrap_or_default()
    }
}

/// A `DeltaDiscoveryResponse` as it arrived.
#[derive(Debug, Clone, Default)]
pub struct Response {
    buf: Bytes,
    type_url: Span,
    nonce: Span,
    resources: Vec<Span>,
    removed: Vec<Span>,
    body_bytes: u64,
}

/// One resource of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResourceView<'a> {
    /// The resource's name.
    pub name: &'a str,
    /// istiod's version of it.
    pub version: &'a str,
    /// Its body, if it has one.
    pub body: Option<AnyView<'a>>,
}

/// A resource's body: a `google.protobuf.Any`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnyView<'a> {
    /// The body's type URL.
    pub type_url: &'a str,
    /// The encoded message.
    pub value: &'a [u8],
}

impl Response {
    /// Reads a response from its encoding, checking it whole (see the
    /// module doc); the bytes are kept, not copied.
    pub fn decode(buf: Bytes) -> Result<Self, WireError> {
        if u32::try_from(buf.len()).is_err() {
            return Err(WireError::TooLarge(buf.len()));
        }
        let mut response = Self::default();
        let max_entries = (buf.len() * MAX_SPAN_BYTES_PER_BYTE).max(MIN_SPAN_ALLOWANCE)
            / std::mem::size_of::<Span>();
        let mut reader = Reader::new(&buf, 0, buf.len());
        while let Some(field) = reader.field(0)? {
            if response.resources.len() + response.removed.len() >= max_entries
                && matches!(field.number, 2 | 6)
            {
                return Err(WireError::TooManyEntries {
                    len: buf.len(),
                    max: max_entries,
                });
            }
            match (field.number, field.value) {
                (2, Value::Bytes(span)) => {
                    let parsed = parse_resource(&buf, span)?;
                    response.body_bytes += parsed.body.map_or(0, |b| u64::from(b.end - b.start));
                    response.resources.push(span);
                }
                (4, Value::Bytes(span)) => {
                    response.type_url = utf8(&buf, span, "DeltaDiscoveryResponse.type_url")?;
                }
                (5, Value::Bytes(span)) => {
                    response.nonce = utf8(&buf, span, "DeltaDiscoveryResponse.nonce")?;
                }
                (6, Value::Bytes(span)) => response.removed.push(utf8(
                    &buf,
                    span,
                    "DeltaDiscoveryResponse.removed_resources",
                )?),
                (1, Value::Bytes(span)) => {
                    utf8(&buf, span, "DeltaDiscoveryResponse.system_version_info")?;
                }
                (1 | 2 | 4 | 5 | 6, _) => return Err(wrong_type(field.at)),
                _ => {}
            }
        }
        // Pushed one by one, the spans may have up to twice the room.
        response.resources.shrink_to_fit();
        response.removed.shrink_to_fit();
        response.buf = buf;
        Ok(response)
    }

    /// The response a decoded message would be on the wire (for tests,
    /// benchmarks and tools that build responses as messages).
    pub fn from_message(message: &DeltaDiscoveryResponse) -> Result<Self, WireError> {
        Self::decode(Bytes::from(prost::Message::encode_to_vec(message)))
    }

    /// The first field in which this reading differs from prost's
    /// decoding of the same bytes, `message` (`None`: they agree): what
    /// the unit tests and the `xds_response` fuzz target check.
    pub fn mismatch(&self, message: &DeltaDiscoveryResponse) -> Option<&'static str> {
        let removed = message.removed_resources.iter().map(String::as_str);
        let bodies: usize = message
            .resources
            .iter()
            .filter_map(|r| r.resource.as_ref())
            .map(|any| any.value.len())
            .sum();
        if self.type_url() != message.type_url {
            Some("type_url")
        } else if self.nonce() != message.nonce {
            Some("nonce")
        } else if !self.removed().eq(removed) {
            Some("removed_resources")
        } else if self.resource_count() != message.resources.len() {
            Some("the resource count")
        } else if self.body_bytes() != bodies as u64 {
            Some("the bodies' bytes")
        } else {
            self.resources()
                .zip(&message.resources)
                .find_map(|(view, resource)| {
                    let body = resource
                        .resource
                        .as_ref()
                        .map(|any| (any.type_url.as_str(), any.value.as_slice()));
                    if view.name != resource.name {
                        Some("a resource's name")
                    } else if view.version != resource.version {
                        Some("a resource's version")
                    } else if view.body.map(|any| (any.type_url, any.value)) != body {
                        Some("a resource's body")
                    } else {
                        None
                    }
                })
        }
    }

    /// The resource type URL.
    pub fn type_url(&self) -> &str {
        self.type_url.str(&self.buf)
    }

    /// The nonce, echoed in the answer.
    pub fn nonce(&self) -> &str {
        self.nonce.str(&self.buf)
    }

    /// How many resources it carries (added or changed).
    pub fn resource_count(&self) -> usize {
        self.resources.len()
    }

    /// The bodies' encoded bytes, summed (what ztunnel counts in
    /// `istio_xds_message_bytes_total`).
    pub fn body_bytes(&self) -> u64 {
        self.body_bytes
    }

    /// The resources, in the order they came.
    pub fn resources(&self) -> impl ExactSizeIterator<Item = ResourceView<'_>> + '_ {
        self.resources.iter().map(|span| {
            // Checked when the message was read: a failure here cannot
            // happen, and would read as a resource without name or body,
            // which is refused as such.
            let parsed = parse_resource(&self.buf, *span).unwrap_or_default();
            ResourceView {
                name: parsed.name.str(&self.buf),
                version: parsed.version.str(&self.buf),
                body: parsed.body_type.map(|type_url| AnyView {
                    type_url: type_url.str(&self.buf),
                    value: parsed.body.unwrap_or_default().of(&self.buf),
                }),
            }
        })
    }

    /// The names removed.
    pub fn removed(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.removed.iter().map(|span| span.str(&self.buf))
    }

    /// How many names it removes.
    pub fn removed_count(&self) -> usize {
        self.removed.len()
    }
}

/// Where a resource's fields lie.
#[derive(Debug, Clone, Copy, Default)]
struct ParsedResource {
    name: Span,
    version: Span,
    /// The `Any`'s type URL, if the resource has a body.
    body_type: Option<Span>,
    body: Option<Span>,
}

fn parse_resource(buf: &[u8], span: Span) -> Result<ParsedResource, WireError> {
    let mut parsed = ParsedResource::default();
    let mut reader = Reader::new(buf, span.start as usize, span.end as usize);
    while let Some(field) = reader.field(0)? {
        match (field.number, field.value) {
            (1, Value::Bytes(s)) => parsed.version = utf8(buf, s, "Resource.version")?,
            (3, Value::Bytes(s)) => parsed.name = utf8(buf, s, "Resource.name")?,
            (4, Value::Bytes(s)) => {
                utf8(buf, s, "Resource.aliases")?;
            }
            (2, Value::Bytes(s)) => {
                // A message field given twice is merged (protobuf's
                // rule): each field of the later one wins.
                let mut type_url = parsed.body_type.unwrap_or_default();
                let mut value = parsed.body.unwrap_or_default();
                let mut any = Reader::new(buf, s.start as usize, s.end as usize);
                while let Some(field) = any.field(0)? {
                    match (field.number, field.value) {
                        (1, Value::Bytes(s)) => type_url = utf8(buf, s, "Any.type_url")?,
                        (2, Value::Bytes(s)) => value = s,
                        (1 | 2, _) => return Err(wrong_type(field.at)),
                        _ => {}
                    }
                }
                parsed.body_type = Some(type_url);
                parsed.body = Some(value);
            }
            (1..=4, _) => return Err(wrong_type(field.at)),
            _ => {}
        }
    }
    Ok(parsed)
}

fn utf8(buf: &[u8], span: Span, field: &'static str) -> Result<Span, WireError> {
    match std::str::from_utf8(span.of(buf)) {
        Ok(_) => Ok(span),
        Err(_) => Err(WireError::NotUtf8 {
            at: span.start as usize,
            field,
        }),
    }
}

fn wrong_type(at: usize) -> WireError {
    WireError::Invalid {
        at,
        what: "a known field with the wrong wire type",
    }
}

/// A field's value: a length-delimited one's span, or anything else
/// (skipped).
#[derive(Debug, Clone, Copy)]
enum Value {
    Bytes(Span),
    Other,
}

#[derive(Debug, Clone, Copy)]
struct Field {
    at: usize,
    number: u64,
    value: Value,
}

/// Reads the fields of one message in `buf[pos..end]`.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    end: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], pos: usize, end: usize) -> Self {
        Self { buf, pos, end }
    }

    fn varint(&mut self, what: &'static str) -> Result<u64, WireError> {
        let at = self.pos;
        let mut value = 0u64;
        for i in 0..10 {
            let byte = match self.buf.get(self.pos) {
                Some(b) if self.pos < self.end => *b,
                _ => return Err(WireError::Truncated { at, what }),
            };
            self.pos += 1;
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                if i == 9 && byte > 1 {
                    break;
                }
                return Ok(value);
            }
        }
        Err(WireError::Invalid {
            at,
            what: "a varint longer than 64 bits",
        })
    }

    fn skip(&mut self, len: u64, at: usize, what: &'static str) -> Result<Span, WireError> {
        let start = self.pos;
        let len = usize::try_from(len).map_err(|_| WireError::Truncated { at, what })?;
        match start.checked_add(len) {
            Some(end) if end <= self.end => {
                self.pos = end;
                // Within the message, which fits in u32 (checked first).
                Ok(Span {
                    start: start as u32,
                    end: end as u32,
                })
            }
            _ => Err(WireError::Truncated { at, what }),
        }
    }

    /// The next field, or `None` at the message's end. `depth` counts
    /// the groups being skipped around it.
    fn field(&mut self, depth: u32) -> Result<Option<Field>, WireError> {
        if self.pos >= self.end {
            return Ok(None);
        }
        let at = self.pos;
        let key = self.varint("a field key")?;
        let number = key >> 3;
        if number == 0 || key > u64::from(u32::MAX) {
            return Err(WireError::Invalid {
                at,
                what: "a field number out of range",
            });
        }
        let value = match key & 7 {
            0 => {
                self.varint("a varint field")?;
                Value::Other
            }
            1 => {
                self.skip(8, at, "a 64-bit field")?;
                Value::Other
            }
            2 => {
                let len = self.varint("a length")?;
                Value::Bytes(self.skip(len, at, "a length-delimited field")?)
            }
            3 => {
                self.skip_group(number, depth + 1, at)?;
                Value::Other
            }
            5 => {
                self.skip(4, at, "a 32-bit field")?;
                Value::Other
            }
            _ => {
                return Err(WireError::Invalid {
                    at,
                    what: "an unknown wire type or an unopened group's end",
                });
            }
        };
        Ok(Some(Field { at, number, value }))
    }

    /// Skips a group's fields up to its end tag.
    fn skip_group(&mut self, number: u64, depth: u32, at: usize) -> Result<(), WireError> {
        if depth > MAX_DEPTH {
            return Err(WireError::Invalid {
                at,
                what: "groups nested too deep",
            });
        }
        loop {
            if self.pos >= self.end {
                return Err(WireError::Truncated {
                    at,
                    what: "a group without its end",
                });
            }
            let key_at = self.pos;
            let key = self.varint("a field key")?;
            if key & 7 == 4 {
                if key >> 3 == number {
                    return Ok(());
                }
                return Err(WireError::Invalid {
                    at: key_at,
                    what: "a group ended by another's tag",
                });
            }
            // Not the end: step back and read the field whole.
            self.pos = key_at;
            self.field(depth)?;
        }
    }
}

#[cfg(test)]
#[path = "wire_tests.rs"]
mod tests;
