//! The cleartext header of RFC 9420 `MLSMessage`s: what the relay reads, and nothing more.
//! The texts of [`Malformed`] say why (`tests/relay/test_relay.py` reads them).
//!
//! Pure functions over bytes, no I/O, no copies beyond the group id and the KeyPackageRefs.
//! Wire format (RFC 9420 §6): `MLSMessage` is `version` (u16, 1 = mls10), `wire_format` (u16),
//! then the body. Variable-length vectors (`opaque x<V>`) carry a QUIC-style variable-length
//! integer (RFC 9000 §16, as RFC 9420 §2.1.2 uses it) giving their length. The reader is plain
//! indexing, so one path reads everything.

use static_proto::content_type;

/// `mls10`, the only protocol version.
const MLS10: u64 = 1;

pub const PUBLIC_MESSAGE: u16 = 1;
pub const PRIVATE_MESSAGE: u16 = 2;
const WELCOME: u16 = 3;
const GROUP_INFO: u16 = 4;
const KEY_PACKAGE: u16 = 5;

/// RFC 9420 content types the relay tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ContentType {
    Application = content_type::APPLICATION,
    Proposal = content_type::PROPOSAL,
    Commit = content_type::COMMIT,
}

impl ContentType {
    fn from_wire(value: u64) -> Result<ContentType, Malformed> {
        match u32::try_from(value) {
            Ok(content_type::APPLICATION) => Ok(ContentType::Application),
            Ok(content_type::PROPOSAL) => Ok(ContentType::Proposal),
            Ok(content_type::COMMIT) => Ok(ContentType::Commit),
            _ => Err(malformed(format!("unknown content type {value}"))),
        }
    }
}

/// The cleartext header of a public (wire format 1) or private (2) message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageHeader {
    pub wire_format: u16,
    pub group_id: Vec<u8>,
    pub epoch: u64,
    pub content_type: ContentType,
}

/// The cleartext part of a Welcome: its cipher suite and the KeyPackageRefs it is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WelcomeHeader {
    pub cipher_suite: u16,
    pub key_package_refs: Vec<Vec<u8>>,
}

/// The bytes are not an MLSMessage the relay accepts; the text says why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Malformed(pub String);

fn malformed(text: impl Into<String>) -> Malformed {
    Malformed(text.into())
}

/// A cursor over the bytes; `what` names the field in the error texts.
struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(data: &'a [u8]) -> Self {
        Reader { data, pos: 0 }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], Malformed> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|end| *end <= self.data.len())
            .ok_or_else(|| malformed(format!("truncated {what}")))?;
        let chunk = &self.data[self.pos..end];
        self.pos = end;
        Ok(chunk)
    }

    /// A big-endian unsigned integer of `size` (at most 8) bytes.
    fn uint(&mut self, size: usize, what: &str) -> Result<u64, Malformed> {
        Ok(self
            .take(size, what)?
            .iter()
            .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    fn varint(&mut self, what: &str) -> Result<u64, Malformed> {
        let first = self.uint(1, what)?;
        let prefix = first >> 6;
        if prefix == 3 {
            return Err(malformed(format!(
                "invalid variable-length integer in {what}"
            )));
        }
        let mut value = first & 0x3f;
        for _ in 0..(1u32 << prefix) - 1 {
            value = (value << 8) | self.uint(1, what)?;
        }
        Ok(value)
    }

    fn vector(&mut self, what: &str) -> Result<&'a [u8], Malformed> {
        let len = self.varint(what)?;
        // A length beyond usize is beyond the data as well.
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        self.take(len, what)
    }

    fn at_end(&self) -> bool {
        self.pos == self.data.len()
    }
}

/// Version and wire format; the wire format is one RFC 9420 knows.
fn preamble(reader: &mut Reader<'_>) -> Result<u16, Malformed> {
    let version = reader.uint(2, "version")?;
    if version != MLS10 {
        return Err(malformed(format!("unsupported protocol version {version}")));
    }
    let wire_format = reader.uint(2, "wire format")?;
    match u16::try_from(wire_format) {
        Ok(wf @ PUBLIC_MESSAGE..=KEY_PACKAGE) => Ok(wf),
        _ => Err(malformed(format!("unknown wire format {wire_format}"))),
    }
}

/// Read the header of a public or private `MLSMessage`.
pub fn parse_message(data: &[u8]) -> Result<MessageHeader, Malformed> {
    let mut reader = Reader::new(data);
    let wire_format = preamble(&mut reader)?;
    let (group_id, epoch, content_type) = match wire_format {
        PUBLIC_MESSAGE => {
            // FramedContent: group_id<V>, epoch u64, sender, authenticated_data<V>,
            // content_type u8, then the content (never empty).
            let group_id = reader.vector("group id")?;
            let epoch = reader.uint(8, "epoch")?;
            match reader.uint(1, "sender")? {
                // member (leaf index) / external (sender index): u32
                1 | 2 => {
                    reader.take(4, "sender")?;
                }
                // new_member_proposal / new_member_commit: empty
                3 | 4 => {}
                other => return Err(malformed(format!("unknown sender type {other}"))),
            }
            reader.vector("authenticated data")?;
            let content_type = ContentType::from_wire(reader.uint(1, "content type")?)?;
            if reader.at_end() {
                return Err(malformed("truncated content"));
            }
            (group_id, epoch, content_type)
        }
        PRIVATE_MESSAGE => {
            // group_id<V>, epoch u64, content_type u8, authenticated_data<V>,
            // encrypted_sender_data<V>, ciphertext<V>.
            let group_id = reader.vector("group id")?;
            let epoch = reader.uint(8, "epoch")?;
            let content_type = ContentType::from_wire(reader.uint(1, "content type")?)?;
            reader.vector("authenticated data")?;
            reader.vector("encrypted sender data")?;
            reader.vector("ciphertext")?;
            if !reader.at_end() {
                return Err(malformed("trailing bytes after the private message"));
            }
            (group_id, epoch, content_type)
        }
        other => {
            let name = match other {
                WELCOME => "welcome",
                GROUP_INFO => "group_info",
                KEY_PACKAGE => "key_package",
                _ => "unknown",
            };
            return Err(malformed(format!(
                "wire format {name} cannot be published to a channel"
            )));
        }
    };
    // The relay stores epoch + 1 after a commit: the last epoch has no successor.
    if epoch == u64::MAX {
        return Err(malformed("epoch out of range"));
    }
    Ok(MessageHeader {
        wire_format,
        group_id: group_id.to_vec(),
        epoch,
        content_type,
    })
}

/// Read an `MLSMessage` holding a Welcome.
pub fn parse_welcome(data: &[u8]) -> Result<WelcomeHeader, Malformed> {
    let mut reader = Reader::new(data);
    if preamble(&mut reader)? != WELCOME {
        return Err(malformed("not a welcome message"));
    }
    let cipher_suite = reader.uint(2, "cipher suite")?;
    let mut secrets = Reader::new(reader.vector("secrets")?);
    let mut key_package_refs = Vec::new();
    while !secrets.at_end() {
        // EncryptedGroupSecrets: new_member (KeyPackageRef<V>), HPKECiphertext
        // {kem_output<V>, ciphertext<V>}.
        key_package_refs.push(secrets.vector("key package ref")?.to_vec());
        secrets.vector("kem output")?;
        secrets.vector("encrypted group secrets")?;
    }
    reader.vector("encrypted group info")?;
    if !reader.at_end() {
        return Err(malformed("trailing bytes after the welcome"));
    }
    if key_package_refs.is_empty() {
        return Err(malformed("a welcome for nobody"));
    }
    Ok(WelcomeHeader {
        // Two bytes read: always fits.
        cipher_suite: u16::try_from(cipher_suite).unwrap_or(u16::MAX),
        key_package_refs,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A QUIC-style varint-prefixed vector.
    fn vector(body: &[u8]) -> Vec<u8> {
        let n = body.len();
        let mut out = if n < 0x40 {
            vec![n as u8]
        } else if n < 0x4000 {
            vec![0x40 | (n >> 8) as u8, n as u8]
        } else {
            let v = (n as u32) | 0x8000_0000;
            v.to_be_bytes().to_vec()
        };
        out.extend_from_slice(body);
        out
    }

    fn private(group: &[u8], epoch: u64, content_type: u8) -> Vec<u8> {
        let mut m = vec![0, 1, 0, 2];
        m.extend(vector(group));
        m.extend(epoch.to_be_bytes());
        m.push(content_type);
        m.extend(vector(b"aad"));
        m.extend(vector(b"sender"));
        m.extend(vector(&[7u8; 100]));
        m
    }

    fn public(group: &[u8], epoch: u64, sender: &[u8], content_type: u8) -> Vec<u8> {
        let mut m = vec![0, 1, 0, 1];
        m.extend(vector(group));
        m.extend(epoch.to_be_bytes());
        m.extend_from_slice(sender);
        m.extend(vector(b""));
        m.push(content_type);
        m.extend_from_slice(b"content and signature");
        m
    }

    fn welcome(refs: &[&[u8]]) -> Vec<u8> {
        let mut secrets = Vec::new();
        for r in refs {
            secrets.extend(vector(r));
            secrets.extend(vector(b"kem"));
            secrets.extend(vector(b"secret"));
        }
        let mut m = vec![0, 1, 0, 3, 0, 1];
        m.extend(vector(&secrets));
        m.extend(vector(b"group info"));
        m
    }

    fn err(data: &[u8]) -> String {
        parse_message(data).unwrap_err().0
    }

    #[test]
    fn private_message() {
        let h = parse_message(&private(b"group", 7, 1)).unwrap();
        assert_eq!(
            h,
            MessageHeader {
                wire_format: 2,
                group_id: b"group".to_vec(),
                epoch: 7,
                content_type: ContentType::Application
            }
        );
        let h = parse_message(&private(&[9u8; 300], 0, 3)).unwrap();
        assert_eq!(h.group_id.len(), 300);
        assert_eq!(h.content_type, ContentType::Commit);
    }

    #[test]
    fn private_message_errors() {
        let mut trailing = private(b"g", 1, 1);
        trailing.push(0);
        assert_eq!(err(&trailing), "trailing bytes after the private message");
        let good = private(b"g", 1, 1);
        assert_eq!(err(&good[..good.len() - 1]), "truncated ciphertext");
        assert_eq!(err(&private(b"g", 1, 4)), "unknown content type 4");
        assert_eq!(err(&private(b"g", u64::MAX, 1)), "epoch out of range");
        assert_eq!(err(&good[..6]), "truncated epoch");
        let mut bad_varint = vec![0, 1, 0, 2, 0xc0];
        bad_varint.extend([0; 20]);
        assert_eq!(
            err(&bad_varint),
            "invalid variable-length integer in group id"
        );
        assert_eq!(err(&[0, 1, 0, 2, 0x40]), "truncated group id");
        assert_eq!(err(&[0, 1, 0, 2, 0x85, 0, 0, 0]), "truncated group id");
    }

    #[test]
    fn public_message() {
        let member = [1u8, 0, 0, 0, 3];
        let h = parse_message(&public(b"grp", 4, &member, 3)).unwrap();
        assert_eq!(
            h,
            MessageHeader {
                wire_format: 1,
                group_id: b"grp".to_vec(),
                epoch: 4,
                content_type: ContentType::Commit
            }
        );
        let h = parse_message(&public(b"grp", 0, &[4], 2)).unwrap();
        assert_eq!(h.content_type, ContentType::Proposal);
        assert_eq!(
            parse_message(&public(b"grp", 0, &[5], 2)).unwrap_err().0,
            "unknown sender type 5"
        );
        let mut cut_sender = vec![0, 1, 0, 1];
        cut_sender.extend(vector(b"grp"));
        cut_sender.extend(0u64.to_be_bytes());
        cut_sender.extend([1, 0, 0]);
        assert_eq!(err(&cut_sender), "truncated sender");
        let mut no_content = public(b"grp", 0, &[3], 1);
        no_content.truncate(no_content.len() - b"content and signature".len());
        assert_eq!(err(&no_content), "truncated content");
        assert_eq!(err(&public(b"grp", 0, &[3], 9)), "unknown content type 9");
    }

    #[test]
    fn preamble_errors() {
        assert_eq!(err(&[]), "truncated version");
        assert_eq!(err(&[0]), "truncated version");
        assert_eq!(err(&[0, 2, 0, 1]), "unsupported protocol version 2");
        assert_eq!(err(&[0, 1, 0]), "truncated wire format");
        assert_eq!(err(&[0, 1, 0, 6]), "unknown wire format 6");
        assert_eq!(err(&[0, 1, 1, 0]), "unknown wire format 256");
        assert_eq!(
            err(&welcome(&[b"r"])),
            "wire format welcome cannot be published to a channel"
        );
        assert_eq!(
            err(&[0, 1, 0, 4]),
            "wire format group_info cannot be published to a channel"
        );
        assert_eq!(
            err(&[0, 1, 0, 5]),
            "wire format key_package cannot be published to a channel"
        );
    }

    #[test]
    fn welcome_message() {
        let w = parse_welcome(&welcome(&[b"ref-1", b"ref-2"])).unwrap();
        assert_eq!(
            w,
            WelcomeHeader {
                cipher_suite: 1,
                key_package_refs: vec![b"ref-1".to_vec(), b"ref-2".to_vec()]
            }
        );
        let e = |d: &[u8]| parse_welcome(d).unwrap_err().0;
        assert_eq!(e(&welcome(&[])), "a welcome for nobody");
        assert_eq!(e(&private(b"g", 0, 1)), "not a welcome message");
        assert_eq!(e(&[0, 1, 0, 9]), "unknown wire format 9");
        let mut trailing = welcome(&[b"r"]);
        trailing.push(1);
        assert_eq!(e(&trailing), "trailing bytes after the welcome");
        let good = welcome(&[b"r"]);
        assert_eq!(e(&good[..good.len() - 1]), "truncated encrypted group info");
        assert_eq!(e(&good[..5]), "truncated cipher suite");
        // A secret cut short inside the secrets vector.
        let mut cut = vec![0, 1, 0, 3, 0, 1];
        cut.extend(vector(&vector(b"ref")));
        cut.extend(vector(b"gi"));
        assert_eq!(e(&cut), "truncated kem output");
    }
}
