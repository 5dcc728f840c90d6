//! The chat page at `/`: static assets compiled into `mlxd` (`include_str!`), so the page
//! loads from the supervisor even while every engine is busy, loading or restarting. The page
//! talks to the same API as any client (`/v1/models`, `/v1/chat/completions`).

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};

use crate::server::ResponseBody;

const INDEX_HTML: &str = include_str!("chat_page/index.html");
const CHAT_JS: &str = include_str!("chat_page/chat.js");

/// Scripts only from this origin, requests only to it, never framed by another site.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; \
                   connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
                   form-action 'none'; frame-ancestors 'none'";

/// The asset served at `path`, if it is one of the page's.
pub fn asset(path: &str) -> Option<(&'static str, &'static str)> {
    match path {
        "/" | "/index.html" => Some((INDEX_HTML, "text/html; charset=utf-8")),
        "/chat.js" => Some((CHAT_JS, "text/javascript; charset=utf-8")),
        _ => None,
    }
}

/// The response for a page asset.
pub fn response(body: &'static str, content_type: &'static str) -> Response<ResponseBody> {
    let mut r = Response::new(
        Full::new(Bytes::from_static(body.as_bytes()))
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    *r.status_mut() = StatusCode::OK;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_the_page_and_its_script_only() {
        let (html, ct) = asset("/").unwrap();
        assert!(ct.starts_with("text/html"));
        assert!(html.contains(r#"<script src="/chat.js""#));
        for id in ["model", "prompt", "send", "stop", "messages", "notice"] {
            assert!(html.contains(&format!(r#"id="{id}""#)), "#{id} missing");
        }
        let (js, ct) = asset("/chat.js").unwrap();
        assert!(ct.starts_with("text/javascript"));
        assert!(js.contains("/v1/chat/completions") && js.contains("/v1/models"));
        assert!(asset("/chat.css").is_none() && asset("/v1").is_none());
        let r = response(html, ct);
        assert_eq!(r.headers()[header::X_FRAME_OPTIONS], "DENY");
        assert!(r.headers()[header::CONTENT_SECURITY_POLICY]
            .to_str()
            .unwrap()
            .contains("script-src 'self'"));
    }
}
