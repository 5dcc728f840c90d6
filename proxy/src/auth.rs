//! Who may talk to mlxd: API keys, an admin key, and the browser-safety checks (Host and
//! Origin) that keep a web page the user visits from driving a loopback server.
//!
//! Pure: [`Guard::check`] looks at a request head and says allow (with CORS headers to
//! add, for an allowed origin) or refuse (as a [`ProxyError`], which `error.rs` renders).
//!
//! Order: the Host check (DNS rebinding: a foreign name resolving to 127.0.0.1), then the
//! Origin check (cross-site requests, including "simple" form POSTs that need no
//! preflight), then keys. The health endpoints and the chat page's static files (`/`, `/chat.js`) need
//! no key; everything else does once keys are
//! configured. Keys are compared as SHA-256 digests in constant time, so neither their
//! content nor their length leaks through timing.

use std::net::IpAddr;

use http::{header, HeaderMap, HeaderValue, Method};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::ProxyError;

/// Names a loopback server always answers to.
const LOOPBACK_NAMES: &[&str] = &["localhost", "127.0.0.1", "::1", "[::1]"];

/// Request headers a browser may send cross-origin to an allowed origin.
const CORS_ALLOW_HEADERS: &str =
    "authorization, content-type, x-api-key, anthropic-version, anthropic-beta, x-request-id";

/// What a route needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// `/health`, `/health/ready`, `/health/live`: open to anyone who passes Host/Origin.
    Open,
    /// The API, `/v1/models`, `/engines`, `/logs`, `/metrics`: an API key (or the admin key).
    Api,
    /// `/admin/*`, `/engines/reset`, `/v1/jobs*` (jobs write to the store and spend memory),
    /// `/api/pull` (Ollama's pull writes to the store): the admin key if one is set, else an
    /// API key.
    Admin,
}

/// The paths open to anyone: exactly the health endpoints (anything else under `/health/`
/// needs a key like any other path, so an anonymous caller can never reach an engine).
const OPEN_PATHS: &[&str] = &["/health", "/health/ready", "/health/live"];

/// The access class of `path`.
pub fn access(path: &str) -> Access {
    if OPEN_PATHS.contains(&path) {
        Access::Open
    } else if crate::chat_page::asset(path).is_some() {
        // The chat page's static files hold no data; the API calls it makes need the key.
        Access::Open
    } else if path.starts_with("/admin/")
        || path == "/engines/reset"
        || path == "/v1/jobs"
        || path.starts_with("/v1/jobs/")
        || path == "/api/pull"
    {
        Access::Admin
    } else {
        Access::Api
    }
}

/// The configured policy, built once at start.
#[derive(Clone)]
pub struct Guard {
    api_keys: Vec<[u8; 32]>,
    admin_keys: Vec<[u8; 32]>,
    /// Lower-case host names (no port) accepted in `Host`; `None`: any (a wildcard bind
    /// with no `allowed_hosts`, where mlxd cannot know its own names).
    hosts: Option<Vec<String>>,
    /// Exact origins (`scheme://host[:port]`, lower case) allowed cross-origin.
    origins: Vec<String>,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material, not even digests.
        f.debug_struct("Guard")
            .field("api_keys", &self.api_keys.len())
            .field("admin_keys", &self.admin_keys.len())
            .field("hosts", &self.hosts)
            .field("origins", &self.origins)
            .finish()
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Every comparison runs, so the time does not depend on which key matched.
fn matches_any(candidate: &[u8; 32], keys: &[[u8; 32]]) -> bool {
    keys.iter()
        .fold(subtle::Choice::from(0), |acc, k| acc | k.ct_eq(candidate))
        .into()
}

/// `host[:port]` → lower-case host.
fn host_name(authority: &str) -> String {
    let a = authority.trim();
    let host = if let Some(rest) = a.strip_prefix('[') {
        // [v6]:port
        rest.split(']')
            .next()
            .map(|h| format!("[{h}]"))
            .unwrap_or_default()
    } else {
        a.rsplit_once(':')
            .filter(|(_, p)| p.chars().all(|c| c.is_ascii_digit()))
            .map_or(a, |(h, _)| h)
            .to_string()
    };
    host.to_ascii_lowercase()
}

/// The settings [`Guard::new`] needs.
#[derive(Debug, Clone, Default)]
pub struct GuardConfig<'a> {
    pub api_keys: &'a [String],
    pub admin_api_key: Option<&'a str>,
    /// The address mlxd binds (`127.0.0.1`, `0.0.0.0`, a name).
    pub bind_host: &'a str,
    pub allowed_hosts: &'a [String],
    pub allowed_origins: &'a [String],
}

impl Guard {
    pub fn new(c: GuardConfig<'_>) -> Self {
        let wildcard = c
            .bind_host
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_unspecified());
        let hosts = if wildcard && c.allowed_hosts.is_empty() {
            None
        } else {
            let mut h: Vec<String> = LOOPBACK_NAMES.iter().map(|s| s.to_string()).collect();
            if !wildcard {
                h.push(host_name(c.bind_host));
                if c.bind_host.contains(':') && !c.bind_host.starts_with('[') {
                    h.push(format!("[{}]", c.bind_host.to_ascii_lowercase()));
                }
            }
            h.extend(c.allowed_hosts.iter().map(|s| host_name(s)));
            Some(h)
        };
        Self {
            api_keys: c.api_keys.iter().map(|k| digest(k)).collect(),
            admin_keys: c.admin_api_key.iter().map(|k| digest(k)).collect(),
            hosts,
            origins: c
                .allowed_origins
                .iter()
                .map(|o| o.trim().trim_end_matches('/').to_ascii_lowercase())
                .collect(),
        }
    }

    /// True when any key is configured (requests must then carry one).
    pub fn keys_required(&self) -> bool {
        !self.api_keys.is_empty() || !self.admin_keys.is_empty()
    }

    /// True when a client's key must not travel on to the engine.
    pub fn consumes_keys(&self) -> bool {
        self.keys_required()
    }

    /// Decides on a request head. `Ok(Some(origin))`: allowed cross-origin request,
    /// whose response gets CORS headers for that origin.
    pub fn check(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
    ) -> Result<Option<HeaderValue>, ProxyError> {
        // RFC 9112 §3.2: a request with more than one Host is a 400, whatever the names.
        if headers.get_all(header::HOST).iter().nth(1).is_some() {
            return Err(ProxyError::BadRequest(
                "the request has more than one Host header".into(),
            ));
        }
        if let Some(hosts) = &self.hosts {
            let host = headers
                .get(header::HOST)
                .and_then(|v| v.to_str().ok())
                .map(host_name);
            match host {
                Some(h) if hosts.contains(&h) => {}
                other => {
                    return Err(ProxyError::Forbidden {
                        code: "host_not_allowed",
                        message: format!(
                            "Host {:?} is not one of the names this server answers to ({}); add it to server.allowed_hosts (--allowed-host) to allow it",
                            other.unwrap_or_default(),
                            hosts.join(", ")
                        ),
                    })
                }
            }
        }
        let origin = match headers.get(header::ORIGIN) {
            None => None,
            Some(v) => {
                let o = v
                    .to_str()
                    .unwrap_or("")
                    .trim_end_matches('/')
                    .to_ascii_lowercase();
                // Same-origin (the chat page at `/` calling the API): the Origin names the
                // Host the request came to, and that Host passed the check above. Without a
                // Host check (a wildcard bind), a DNS-rebinding page could fake this, so it
                // is only trusted with one.
                let same_origin = self.hosts.is_some()
                    && headers
                        .get(header::HOST)
                        .and_then(|v| v.to_str().ok())
                        .is_some_and(|h| o == format!("http://{}", h.to_ascii_lowercase()));
                if same_origin {
                    None
                } else if !self.origins.contains(&o) {
                    return Err(ProxyError::Forbidden {
                        code: "origin_not_allowed",
                        message: format!(
                            "cross-origin requests from {o:?} are not allowed; add the origin to server.allowed_origins (--allowed-origin) to allow it"
                        ),
                    });
                } else {
                    Some(v.clone())
                }
            }
        };
        // A preflight carries no credentials; the actual request will.
        if method == Method::OPTIONS && origin.is_some() {
            return Ok(origin);
        }
        let need = access(path);
        if need == Access::Open || !self.keys_required() {
            return Ok(origin);
        }
        let Some(presented) = presented_key(headers) else {
            return Err(ProxyError::Unauthorized {
                message: "an API key is required: send it as \"Authorization: Bearer <key>\" or \"x-api-key: <key>\"".into(),
            });
        };
        let d = digest(presented);
        let admin = matches_any(&d, &self.admin_keys);
        let api = matches_any(&d, &self.api_keys);
        let ok = match need {
            Access::Open => true,
            Access::Api => api | admin,
            Access::Admin if self.admin_keys.is_empty() => api,
            Access::Admin => admin,
        };
        if ok {
            Ok(origin)
        } else if need == Access::Admin && api {
            Err(ProxyError::Forbidden {
                code: "admin_key_required",
                message: format!("{path} needs the admin API key (server.admin_api_key)"),
            })
        } else {
            Err(ProxyError::Unauthorized {
                message: "the API key is not valid".into(),
            })
        }
    }

    /// Removes the client's credentials before a request goes to an engine.
    pub fn strip_credentials(&self, headers: &mut HeaderMap) {
        if self.consumes_keys() {
            headers.remove(header::AUTHORIZATION);
            headers.remove("x-api-key");
        }
    }
}

/// `Authorization: Bearer <key>`, else `x-api-key: <key>`.
fn presented_key(headers: &HeaderMap) -> Option<&str> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
        });
    bearer
        .or_else(|| {
            headers
                .get("x-api-key")
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
        })
        .filter(|k| !k.is_empty())
}

/// Headers for a response to an allowed cross-origin request (and its preflight).
pub fn cors_headers(h: &mut HeaderMap, origin: HeaderValue, preflight: bool) {
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    if preflight {
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static(CORS_ALLOW_HEADERS),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
    }
}

/// Whether binding `host` exposes mlxd beyond this machine.
pub fn is_loopback_bind(host: &str) -> bool {
    match host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        Ok(ip) => ip.is_loopback(),
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(keys: &[&str], admin: Option<&str>, bind: &str) -> Guard {
        let keys: Vec<String> = keys.iter().map(|s| s.to_string()).collect();
        let origins = vec!["http://app.example:3000".to_string()];
        Guard::new(GuardConfig {
            api_keys: &keys,
            admin_api_key: admin,
            bind_host: bind,
            allowed_hosts: &["mlxd.lan".to_string()],
            allowed_origins: &origins,
        })
    }

    fn head(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn code(r: Result<Option<HeaderValue>, ProxyError>) -> String {
        match r {
            Ok(_) => "ok".into(),
            Err(e) => format!("{} {}", e.status().as_u16(), e.kind().1.unwrap_or("")),
        }
    }

    #[test]
    fn routes_are_classified() {
        assert_eq!(access("/health"), Access::Open);
        assert_eq!(access("/health/ready"), Access::Open);
        assert_eq!(access("/health/live"), Access::Open);
        assert_eq!(access("/healthz"), Access::Api);
        assert_eq!(access("/api/pull"), Access::Admin);
        assert_eq!(access("/api/chat"), Access::Api);
        assert_eq!(access("/health/x"), Access::Api);
        assert_eq!(access("/health/live/"), Access::Api);
        assert_eq!(access("/metrics"), Access::Api);
        assert_eq!(access("/logs/x"), Access::Api);
        assert_eq!(access("/engines"), Access::Api);
        assert_eq!(access("/engines/reset"), Access::Admin);
        assert_eq!(access("/admin/models/a/unload"), Access::Admin);
    }

    #[test]
    fn keys_bearer_and_x_api_key() {
        let g = guard(&["k1", "k2"], Some("adm"), "127.0.0.1");
        let get = |h: &[(&str, &str)], path| code(g.check(&Method::GET, path, &head(h)));
        let host = ("host", "127.0.0.1:8080");
        assert_eq!(get(&[host], "/health"), "ok");
        assert_eq!(get(&[host], "/v1/models"), "401 invalid_api_key");
        assert_eq!(
            get(&[host, ("authorization", "Bearer k2")], "/v1/models"),
            "ok"
        );
        assert_eq!(
            get(&[host, ("authorization", "bearer  k1 ")], "/metrics"),
            "ok"
        );
        assert_eq!(get(&[host, ("x-api-key", "k1")], "/logs/a"), "ok");
        assert_eq!(
            get(&[host, ("x-api-key", "k3")], "/engines"),
            "401 invalid_api_key"
        );
        assert_eq!(
            get(&[host, ("authorization", "Basic k1")], "/engines"),
            "401 invalid_api_key"
        );
        assert_eq!(
            get(&[host, ("x-api-key", "k1")], "/engines/reset"),
            "403 admin_key_required"
        );
        assert_eq!(get(&[host, ("x-api-key", "adm")], "/engines/reset"), "ok");
        assert_eq!(
            get(&[host, ("x-api-key", "adm")], "/v1/chat/completions"),
            "ok"
        );
        // Without an admin key, API keys open the admin routes.
        let g = guard(&["k1"], None, "127.0.0.1");
        assert_eq!(
            code(g.check(
                &Method::POST,
                "/admin/models/a/load",
                &head(&[host, ("x-api-key", "k1")])
            )),
            "ok"
        );
        // No keys: open.
        let g = guard(&[], None, "127.0.0.1");
        assert!(!g.keys_required());
        assert_eq!(
            code(g.check(&Method::POST, "/engines/reset", &head(&[host]))),
            "ok"
        );
    }

    #[test]
    fn host_check_stops_dns_rebinding() {
        let g = guard(&[], None, "127.0.0.1");
        let get = |h: &str| code(g.check(&Method::GET, "/v1/models", &head(&[("host", h)])));
        for ok in [
            "127.0.0.1:8080",
            "localhost",
            "LOCALHOST:1",
            "[::1]:8080",
            "mlxd.lan:8080",
        ] {
            assert_eq!(get(ok), "ok", "{ok}");
        }
        assert_eq!(get("evil.example:8080"), "403 host_not_allowed");
        let mut two = head(&[("host", "localhost")]);
        two.append(header::HOST, HeaderValue::from_static("localhost"));
        assert_eq!(code(g.check(&Method::GET, "/v1/models", &two)), "400 ");
        assert_eq!(
            code(g.check(&Method::GET, "/health", &HeaderMap::new())),
            "403 host_not_allowed"
        );
        // A wildcard bind without allowed_hosts cannot know its names: no Host check.
        let g = Guard::new(GuardConfig {
            bind_host: "0.0.0.0",
            ..GuardConfig::default()
        });
        assert_eq!(
            code(g.check(&Method::GET, "/", &head(&[("host", "10.0.0.5:8080")]))),
            "ok"
        );
    }

    #[test]
    fn origins_are_an_allow_list() {
        let g = guard(&["k"], None, "127.0.0.1");
        let host = ("host", "localhost:8080");
        let r = g.check(
            &Method::POST,
            "/admin/models/a/unload",
            &head(&[host, ("origin", "http://evil.example")]),
        );
        assert_eq!(code(r), "403 origin_not_allowed");
        // Preflight from an allowed origin: allowed without a key.
        let r = g.check(
            &Method::OPTIONS,
            "/v1/chat/completions",
            &head(&[host, ("origin", "http://app.example:3000")]),
        );
        assert_eq!(r.unwrap().unwrap(), "http://app.example:3000");
        // The real request still needs the key.
        let r = g.check(
            &Method::POST,
            "/v1/chat/completions",
            &head(&[host, ("origin", "http://app.example:3000")]),
        );
        assert_eq!(code(r), "401 invalid_api_key");
        assert_eq!(
            code(g.check(&Method::GET, "/health", &head(&[host, ("origin", "null")]))),
            "403 origin_not_allowed"
        );
    }

    /// The chat page at `/` posts to the API with its own origin: allowed (no CORS headers
    /// needed) when the Host was checked; a wildcard bind, which checks no Host, still asks
    /// for the origin to be allowed, so a DNS-rebinding page cannot pass as same-origin.
    #[test]
    fn same_origin_requests_from_the_chat_page() {
        let g = guard(&[], None, "127.0.0.1");
        let post = |g: &Guard, host: &str, origin: &str| {
            g.check(
                &Method::POST,
                "/v1/chat/completions",
                &head(&[("host", host), ("origin", origin)]),
            )
        };
        let r = post(&g, "127.0.0.1:8080", "http://127.0.0.1:8080");
        assert_eq!(r.unwrap(), None);
        assert_eq!(
            code(post(&g, "127.0.0.1:8080", "http://127.0.0.1:9999")),
            "403 origin_not_allowed"
        );
        assert_eq!(
            code(post(&g, "127.0.0.1:8080", "https://127.0.0.1:8080")),
            "403 origin_not_allowed"
        );
        let wild = Guard::new(GuardConfig {
            bind_host: "0.0.0.0",
            ..GuardConfig::default()
        });
        assert_eq!(
            code(post(&wild, "evil.example:8080", "http://evil.example:8080")),
            "403 origin_not_allowed"
        );
        assert_eq!(
            code(g.check(&Method::GET, "/", &head(&[("host", "localhost")]))),
            "ok"
        );
    }

    #[test]
    fn loopback_binds() {
        for h in ["127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"] {
            assert!(is_loopback_bind(h), "{h}");
        }
        for h in ["0.0.0.0", "::", "192.168.1.2", "mlxd.lan"] {
            assert!(!is_loopback_bind(h), "{h}");
        }
    }

    #[test]
    fn debug_never_shows_keys() {
        let g = guard(&["secret-key"], Some("admin-secret"), "127.0.0.1");
        let d = format!("{g:?}");
        assert!(!d.contains("secret"), "{d}");
    }
}
