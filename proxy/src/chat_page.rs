//! The chat page at `/`: static assets compiled into `mlxd` (`include_str!`), so the page
//! loads from the supervisor even while every engine is busy, loading or restarting. The page
//! talks to the same API as any client (`/v1/models`, `/v1/chat/completions`).

use http::{header, HeaderValue, Response, StatusCode};

use crate::response_body::{self, ResponseBody};

const HTML: &str = "text/html; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";
const TEXT: &str = "text/plain; charset=utf-8";

/// Every file of the page: its path, body and content type. The page's own scripts are ES
/// modules; `vendor/` holds the markdown parser and HTML sanitizer, copied unchanged from
/// npm (see `chat_page/vendor/README.md`) so the page needs no network beyond `mlxd`.
const ASSETS: &[(&str, &str, &str)] = &[
    ("/", include_str!("chat_page/index.html"), HTML),
    ("/index.html", include_str!("chat_page/index.html"), HTML),
    ("/chat.css", include_str!("chat_page/chat.css"), CSS),
    ("/chat.js", include_str!("chat_page/chat.js"), JS),
    ("/api.js", include_str!("chat_page/api.js"), JS),
    ("/store.js", include_str!("chat_page/store.js"), JS),
    ("/render.js", include_str!("chat_page/render.js"), JS),
    ("/highlight.js", include_str!("chat_page/highlight.js"), JS),
    (
        "/vendor/marked.umd.js",
        include_str!("chat_page/vendor/marked.umd.js"),
        JS,
    ),
    (
        "/vendor/purify.min.js",
        include_str!("chat_page/vendor/purify.min.js"),
        JS,
    ),
    ("/vendor/licenses.txt", LICENSES, TEXT),
];

/// The vendored libraries' licenses, served with them.
const LICENSES: &str = concat!(
    "The mlxd chat page bundles these libraries, unchanged from npm.\n\n",
    "== marked 18.2.1 (/vendor/marked.umd.js) ==\n\n",
    include_str!("chat_page/vendor/LICENSE-marked.md"),
    "\n\n== DOMPurify 3.4.18 (/vendor/purify.min.js), used under the Apache License 2.0 ==\n\n",
    include_str!("chat_page/vendor/LICENSE-dompurify.txt"),
);

/// Scripts and styles only from this origin (no inline code, so HTML that slipped into
/// an answer could not run or restyle the page), requests only to it, never framed.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                   connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
                   form-action 'none'; frame-ancestors 'none'";

/// The asset served at `path`, if it is one of the page's.
pub fn asset(path: &str) -> Option<(&'static str, &'static str)> {
    ASSETS
        .iter()
        .find(|(p, _, _)| *p == path)
        .map(|&(_, body, content_type)| (body, content_type))
}

/// The response for a page asset.
pub fn response(body: &'static str, content_type: &'static str) -> Response<ResponseBody> {
    let mut r = Response::new(response_body::full(body));
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
    fn serves_the_page_and_its_files_only() {
        let (html, ct) = asset("/").unwrap();
        assert!(ct.starts_with("text/html"));
        for id in [
            "model",
            "prompt",
            "send",
            "stop",
            "messages",
            "notice",
            "conversations",
            "settings",
            "system",
            "temperature",
            "top_p",
            "max_tokens",
        ] {
            assert!(html.contains(&format!(r#"id="{id}""#)), "#{id} missing");
        }
        let (js, ct) = asset("/chat.js").unwrap();
        assert!(ct.starts_with("text/javascript"));
        assert!(js.contains("./api.js"));
        let (api, _) = asset("/api.js").unwrap();
        assert!(api.contains("/v1/chat/completions") && api.contains("/v1/models"));
        assert!(asset("/chat.css").unwrap().1.starts_with("text/css"));
        assert!(asset("/vendor/licenses.txt").unwrap().0.contains("MIT"));
        assert!(asset("/vendor/").is_none() && asset("/v1").is_none());
        let r = response(html, ct);
        assert_eq!(r.headers()[header::X_FRAME_OPTIONS], "DENY");
        let csp = r.headers()[header::CONTENT_SECURITY_POLICY]
            .to_str()
            .unwrap();
        assert!(csp.contains("script-src 'self';") && !csp.contains("unsafe-inline"));
    }

    /// Every file the page and its modules ask for is served: a missing one would break the
    /// page only in a browser.
    #[test]
    fn every_referenced_file_is_served() {
        let (html, _) = asset("/").unwrap();
        for attr in html.split(['"', '\'']).filter(|s| s.starts_with('/')) {
            if attr.len() > 1 {
                assert!(
                    asset(attr).is_some(),
                    "index.html refers to {attr}, not served"
                );
            }
        }
        for &(path, body, _) in ASSETS
            .iter()
            .filter(|a| a.2 == JS && !a.0.contains("vendor"))
        {
            for line in body.lines().filter(|l| l.starts_with("import ")) {
                let from = line.split('"').nth(1).expect("import has a quoted path");
                let served = format!("/{}", from.trim_start_matches("./"));
                assert!(
                    asset(&served).is_some(),
                    "{path} imports {from}, not served"
                );
            }
        }
    }

    /// The page stays small: the vendored libraries under 150 KB, everything under 250 KB.
    #[test]
    fn assets_stay_within_their_size_budget() {
        let vendored: usize = ASSETS
            .iter()
            .filter(|a| a.0.starts_with("/vendor/"))
            .map(|a| a.1.len())
            .sum();
        assert!(vendored < 150_000, "vendored assets are {vendored} bytes");
        let all: usize = ASSETS
            .iter()
            .filter(|a| a.0 != "/index.html")
            .map(|a| a.1.len())
            .sum();
        assert!(all < 250_000, "the page's assets are {all} bytes");
    }
}
