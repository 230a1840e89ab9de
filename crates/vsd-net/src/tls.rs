//! TLS for NBD connections, on rustls: X.509 credentials read from a
//! directory with QEMU's file names (`tls-creds-x509`, a server's or a
//! client's), and a connection's wire once NBD_OPT_STARTTLS was agreed.
//!
//! A TLS connection's memory stays bounded: rustls keeps at most
//! [`TLS_BUFFER`] of records to send, 16 KiB of decrypted bytes not yet
//! read, and one record being received (at most 16 KiB and change; a
//! handshake message, during the handshake, at most 64 KiB); the
//! transmission phase reads no more records while decrypted bytes wait.

use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, ring};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    CertificateError, ClientConfig, ClientConnection, Connection, DigitallySignedStruct, RootCertStore, ServerConfig,
    ServerConnection, SignatureScheme,
};

use crate::stream::{Stream, Wire};

/// QEMU's file names in a `tls-creds-x509` directory.
const CA_CERT: &str = "ca-cert.pem";
const CA_CRL: &str = "ca-crl.pem";
const SERVER_CERT: &str = "server-cert.pem";
const SERVER_KEY: &str = "server-key.pem";
const CLIENT_CERT: &str = "client-cert.pem";
const CLIENT_KEY: &str = "client-key.pem";

/// Bytes of encrypted records a connection may hold unsent: a client that
/// stops reading stops being answered, as on a plain connection.
const TLS_BUFFER: usize = 64 << 10;

/// Why credentials could not be loaded; the messages are QEMU's.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file the server needs is not there or not readable.
    #[error("Unable to access credentials {}", path.display())]
    Access {
        /// The file.
        path: PathBuf,
        /// The host's answer.
        #[source]
        source: io::Error,
    },
    /// A file is not what its name says.
    #[error("Cannot load {what} '{}'", path.display())]
    Parse {
        /// What the file should hold.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The certificate, key and CA do not make a usable server or client.
    #[error("Cannot load certificate & key from '{}'", dir.display())]
    Config {
        /// The credentials' directory.
        dir: PathBuf,
        /// rustls' answer.
        #[source]
        source: rustls::Error,
    },
}

/// Server credentials: what every TLS connection of the server starts from.
pub struct ServerCreds {
    config: Arc<ServerConfig>,
}

impl std::fmt::Debug for ServerCreds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerCreds")
    }
}

impl ServerCreds {
    /// Reads `ca-cert.pem`, `server-cert.pem` (the chain, the server's
    /// first), `server-key.pem` and, if there, `ca-crl.pem` from `dir`.
    /// With `verify_peer`, clients must present a certificate the CA signed.
    pub fn load(dir: &Path, verify_peer: bool) -> Result<Self, TlsError> {
        let provider = Arc::new(ring::default_provider());
        let roots = authorities(dir)?;
        let chain = certificates(&dir.join(SERVER_CERT), "server certificate")?;
        let key = private_key(&dir.join(SERVER_KEY), "server key")?;
        let config_error = |source| TlsError::Config { dir: dir.to_path_buf(), source };
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(config_error)?;
        let builder = if verify_peer {
            let mut verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let crl_path = dir.join(CA_CRL);
            // Optional, as in QEMU: absent means nothing is revoked.
            if crl_path.exists() {
                let crls = CertificateRevocationListDer::pem_slice_iter(&read(&crl_path)?)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| parse_error("CRL", &crl_path, e))?;
                verifier = verifier.with_crls(crls);
            }
            let verifier = verifier.build().map_err(|e| config_error(rustls::Error::General(e.to_string())))?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let config = builder.with_single_cert(chain, key).map_err(config_error)?;
        Ok(Self { config: Arc::new(config) })
    }

    /// A new server side of a TLS session.
    pub fn accept(&self) -> io::Result<ServerConnection> {
        ServerConnection::new(self.config.clone()).map_err(io::Error::other)
    }
}

/// Client credentials: the CA that signs the servers' certificates, and
/// the client's own certificate if the directory has one.
pub struct ClientCreds {
    config: Arc<ClientConfig>,
}

impl std::fmt::Debug for ClientCreds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientCreds")
    }
}

impl ClientCreds {
    /// Reads `ca-cert.pem` and, if both are there, `client-cert.pem` (the
    /// chain) and `client-key.pem` from `dir`.
    pub fn load(dir: &Path) -> Result<Self, TlsError> {
        let provider = Arc::new(ring::default_provider());
        let roots = Arc::new(authorities(dir)?);
        let config_error = |source| TlsError::Config { dir: dir.to_path_buf(), source };
        let verifier = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
            .build()
            .map_err(|e| config_error(rustls::Error::General(e.to_string())))?;
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(config_error)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NameOptional { inner: verifier, provider }));
        let (cert, key) = (dir.join(CLIENT_CERT), dir.join(CLIENT_KEY));
        let config = if cert.exists() && key.exists() {
            let chain = certificates(&cert, "client certificate")?;
            builder.with_client_auth_cert(chain, private_key(&key, "client key")?).map_err(config_error)?
        } else {
            builder.with_no_client_auth()
        };
        Ok(Self { config: Arc::new(config) })
    }

    /// A new client side of a TLS session with the server named `host`, or
    /// with any server the CA signed when there is no name to check (a
    /// unix socket without `tls-hostname`, as QEMU and libnbd do).
    pub fn connect(&self, host: Option<&str>) -> io::Result<ClientConnection> {
        let name = match host {
            Some(host) => ServerName::try_from(host.to_string()).map_err(io::Error::other)?,
            None => ServerName::try_from(ANY_NAME).map_err(io::Error::other)?,
        };
        ClientConnection::new(self.config.clone(), name).map_err(io::Error::other)
    }
}

/// The name a client without a host name asks for; [`NameOptional`] lets
/// any name pass for it.
const ANY_NAME: &str = "vsd.invalid";

/// The CA's chain check, and the name check unless there is no name.
#[derive(Debug)]
struct NameOptional {
    inner: Arc<WebPkiServerVerifier>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for NameOptional {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.inner.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if server_name.to_str() == ANY_NAME => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        signature: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            signature,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        signature: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            signature,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The CA certificates of `dir`.
fn authorities(dir: &Path) -> Result<RootCertStore, TlsError> {
    let ca_path = dir.join(CA_CERT);
    let mut roots = RootCertStore::empty();
    for cert in certificates(&ca_path, "CA certificate")? {
        roots.add(cert).map_err(|e| parse_error("CA certificate", &ca_path, e))?;
    }
    Ok(roots)
}

fn private_key(path: &Path, what: &'static str) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(&read(path)?).map_err(|e| parse_error(what, path, e))
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Access { path: path.to_path_buf(), source })
}

fn parse_error(
    what: &'static str,
    path: &Path,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> TlsError {
    TlsError::Parse { what, path: path.to_path_buf(), source: source.into() }
}

/// Every certificate in a PEM file; at least one.
fn certificates(path: &Path, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(&read(path)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| parse_error(what, path, e))?;
    if certs.is_empty() {
        return Err(parse_error(what, path, "no certificate in the file"));
    }
    Ok(certs)
}

/// A connection after STARTTLS: what comes in is decrypted and what goes
/// out encrypted through rustls' buffers, on the socket (non-blocking in
/// the transmission phase; a blocking socket works too, for handshakes).
pub struct TlsStream {
    tls: Connection,
    socket: Stream,
}

impl TlsStream {
    /// A session `tls` (a server's or a client's) over `socket`.
    pub fn new(tls: impl Into<Connection>, socket: Stream) -> Self {
        let mut tls = tls.into();
        tls.set_buffer_limit(Some(TLS_BUFFER));
        Self { tls, socket }
    }

    /// Runs the TLS handshake to its end, on a blocking socket.
    pub fn handshake(&mut self) -> io::Result<()> {
        while self.tls.is_handshaking() {
            self.tls.complete_io(&mut &self.socket)?;
        }
        Ok(())
    }

    /// Writes queued records until the socket is full; true if any went out.
    fn write_records(&mut self) -> io::Result<bool> {
        let mut wrote = false;
        while self.tls.wants_write() {
            match self.tls.write_tls(&mut &self.socket) {
                Ok(_) => wrote = true,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(wrote)
    }
}

impl Wire for TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.tls.reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            // Nothing decrypted is waiting: take records off the socket.
            // Only now, so that decrypted bytes never pile up.
            if self.tls.read_tls(&mut &self.socket)? == 0 {
                return Ok(0);
            }
            if let Err(e) = self.tls.process_new_packets() {
                // Tell the client why (an alert), if the socket takes it.
                let _ = self.write_records();
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        loop {
            // Takes no more than the records the buffer limit leaves room for.
            let taken = self.tls.writer().write_vectored(bufs)?;
            let wrote = self.write_records()?;
            if taken > 0 {
                return Ok(taken);
            }
            if !wrote {
                return Err(io::ErrorKind::WouldBlock.into());
            }
        }
    }

    fn flush_held(&mut self) -> io::Result<bool> {
        self.write_records()
    }

    fn holds_back(&self) -> bool {
        self.tls.wants_write()
    }

    fn close(&mut self) {
        self.tls.send_close_notify();
        let _ = self.write_records();
    }
}

/// Blocking use (a handshake): reads and writes that wait on the socket.
impl Read for TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        Wire::read(self, buf)
    }
}

impl Write for TlsStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Wire::write_vectored(self, &[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        Wire::write_vectored(self, bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        while self.tls.wants_write() {
            self.write_records()?;
        }
        Ok(())
    }
}

impl AsRawFd for TlsStream {
    fn as_raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }
}
