//! Making groups: a key package for others to add us with, a new group, joining by Welcome.

use super::*;

/// Why a Welcome is refused, in words: above all, a Welcome for someone else's key package.
fn welcome_error<S: std::fmt::Debug + std::fmt::Display>(err: WelcomeError<S>) -> JoinError {
    match err {
        WelcomeError::NoMatchingKeyPackage => JoinError::NotForUs,
        err => JoinError::Invalid {
            detail: openmls_detail(&err),
        },
    }
}

/// A key package for the relay's directory, with its binding (see
/// [`Engine::directory_key_packages`]).
#[derive(Debug, Clone)]
pub struct DirectoryKeyPackage {
    /// A TLS-serialized `MLSMessage(key_package)`.
    pub key_package: Vec<u8>,
    /// Its `KeyPackageBindingContent` signature.
    pub binding: Vec<u8>,
    pub last_resort: bool,
}

/// A key package's leaf HPKE encryption key, as raw bytes (what its binding names).
pub fn key_package_encryption_key(package: &KeyPackage) -> Result<Vec<u8>> {
    // EncryptionKey's raw bytes are not public: its TLS encoding is one variable-length vector.
    let encoded = package
        .leaf_node()
        .encryption_key()
        .tls_serialize_detached()
        .map_err(|e| KeyPackageError::Create {
            detail: e.to_string(),
        })?;
    let key = VLBytes::tls_deserialize_exact(&encoded).map_err(|e| KeyPackageError::Create {
        detail: e.to_string(),
    })?;
    Ok(key.as_slice().to_vec())
}

impl Engine {
    /// Builds a key package of ours (its private keys stored through `provider`).
    fn build_key_package(
        &self,
        provider: &Provider<'_>,
        builder: KeyPackageBuilder,
    ) -> Result<KeyPackageBundle> {
        Ok(builder
            .build(CIPHERSUITE, provider, &self.signer, self.credential.clone())
            .map_err(|e| KeyPackageError::Create {
                detail: openmls_detail(&e),
            })?)
    }

    /// A fresh key package (an `MLSMessage`), its private keys stored until a Welcome uses it.
    pub fn generate_key_package(&self) -> Result<Vec<u8>> {
        let db = lock(&self.db);
        db.transaction(|conn| {
            let provider = Provider::new(&self.crypto, conn);
            let bundle = self.build_key_package(&provider, KeyPackage::builder())?;
            serialize(&MlsMessageOut::from(bundle.key_package().clone()))
        })
    }

    /// Key packages for the relay's directory (`OfferKeyPackages`), each with its binding to
    /// `account` under our identity ([`crate::binding::key_package_binding_tbs`]): `count`
    /// one-time packages, then a last-resort one when `last_resort` (RFC 9420 §16.8). Their
    /// leaves list the last_resort extension among their capabilities (so the last-resort
    /// package validates, and every package of ours looks alike). The private keys are stored
    /// until a Welcome uses them, in one transaction.
    pub fn directory_key_packages(
        &self,
        account: &str,
        count: usize,
        last_resort: bool,
    ) -> Result<Vec<DirectoryKeyPackage>> {
        let identity = self.credential.credential.serialized_content().to_vec();
        let capabilities =
            Capabilities::new(None, None, Some(&[ExtensionType::LastResort]), None, None);
        let db = lock(&self.db);
        db.transaction(|conn| {
            let provider = Provider::new(&self.crypto, conn);
            let total = count + usize::from(last_resort);
            let mut out = Vec::with_capacity(total);
            for i in 0..total {
                let mut builder =
                    KeyPackage::builder().leaf_node_capabilities(capabilities.clone());
                let is_last_resort = i == count;
                if is_last_resort {
                    builder = builder.mark_as_last_resort();
                }
                let bundle = self.build_key_package(&provider, builder)?;
                let package = bundle.key_package();
                let tbs = crate::binding::key_package_binding_tbs(
                    &identity,
                    account,
                    &key_package_encryption_key(package)?,
                );
                out.push(DirectoryKeyPackage {
                    key_package: serialize(&MlsMessageOut::from(package.clone()))?,
                    binding: self.signer.sign_bytes(&tbs),
                    last_resort: is_last_resort,
                });
            }
            Ok(out)
        })
    }

    /// Creates the group of `channel` (group id = the name's UTF-8 bytes) with us as its only
    /// member, at epoch 0.
    pub fn create_group(&self, channel: &str) -> Result<()> {
        self.create_group_with_relay(channel, None)
    }

    /// [`Engine::create_group`], naming the relay whose external sender signature key is
    /// `relay_key` (GetRelayInfo's) in the group context's `external_senders` extension: the
    /// relay may then propose the removal of leaves whose binding's API key is no longer
    /// active (RFC 9420 §12.1.8.1; docs/design.md §5.2). None: no external sender (the group
    /// as before).
    pub fn create_group_with_relay(&self, channel: &str, relay_key: Option<&[u8]>) -> Result<()> {
        validate_channel_name(channel)?;
        let slot = self.new_slot(channel)?;
        let slot = lock(&slot);
        let db = lock(&self.db);
        let group = db.transaction(|conn| {
            let provider = Provider::new(&self.crypto, conn);
            let group = MlsGroup::new_with_group_id(
                &provider,
                &self.signer,
                &create_config(relay_key),
                group_id_of(channel),
                self.credential.clone(),
            )
            .map_err(|e| CreateGroupError::Create {
                channel: channel.to_owned(),
                detail: openmls_detail(&e),
            })?;
            store::rows::insert_group(conn, channel)?;
            store::rows::set_cursor(conn, channel, Cursor::After(0))?;
            Ok::<_, Error>(group)
        });
        self.install_group(slot, channel, group)
    }

    /// Joins `channel` from a Welcome (an `MLSMessage`, or a bare Welcome) that must be for
    /// that channel and carry the ratchet tree.
    pub fn join_group(&self, channel: &str, welcome: &[u8]) -> Result<()> {
        validate_channel_name(channel)?;
        check_len(welcome, JoinError::Empty, |len| JoinError::TooLarge { len })?;
        let welcome = match MlsMessageIn::tls_deserialize_exact(welcome) {
            Ok(msg) => match msg.extract() {
                MlsMessageBodyIn::Welcome(w) => w,
                _ => return Err(JoinError::NotAWelcome.into()),
            },
            Err(_) => {
                Welcome::tls_deserialize_exact(welcome).map_err(|e| JoinError::Malformed {
                    detail: decode_detail(&e),
                })?
            }
        };
        if welcome.ciphersuite() != CIPHERSUITE {
            return Err(JoinError::Ciphersuite {
                found: welcome.ciphersuite(),
            }
            .into());
        }
        let slot = self.new_slot(channel)?;
        let slot = lock(&slot);
        let db = lock(&self.db);
        let expected = group_id_of(channel);
        let group = db.transaction(|conn| {
            let provider = Provider::new(&self.crypto, conn);
            let wrong_channel = |group: &GroupId| JoinError::WrongChannel {
                group: String::from_utf8_lossy(group.as_slice()).into_owned(),
                channel: channel.to_owned(),
            };
            let processed = ProcessedWelcome::new_from_welcome(&provider, &join_config(), welcome)
                .map_err(welcome_error)?;
            let claimed = processed.unverified_group_info().group_id().clone();
            if claimed != expected {
                return Err(wrong_channel(&claimed).into());
            }
            let staged = processed
                .into_staged_welcome(&provider, None)
                .map_err(welcome_error)?;
            if staged.group_context().group_id() != &expected {
                return Err(wrong_channel(staged.group_context().group_id()).into());
            }
            let group = staged
                .into_group(&provider)
                .map_err(|e| JoinError::Invalid {
                    detail: openmls_detail(&e),
                })?;
            store::rows::insert_group(conn, channel)?;
            store::rows::set_cursor(conn, channel, Cursor::FromEpoch(group.epoch().as_u64()))?;
            Ok(group)
        });
        self.install_group(slot, channel, group)
    }
}
