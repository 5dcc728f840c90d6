//! LoRA adapters loaded into a model's engine at run time, through `mlxd`'s admin routes
//! (`/admin/models/{model}/adapters`): list, load, unload. A loaded adapter is then a model
//! of its own for every chat method: `"model": "<model>:<name>"`.
//!
//! ```no_run
//! use mlxd_client::{ChatCompletionRequest, ChatMessage, Client, CompletionClient, Role};
//! # async fn run() -> Result<(), mlxd_client::ClientError> {
//! let client = Client::builder().http("http://127.0.0.1:8080")?;
//! let sql = client
//!     .load_adapter("llama", "sql", "/home/me/.cache/mlxd/adapters/sql")
//!     .await?;
//! let answer = client
//!     .complete(ChatCompletionRequest {
//!         model: Some(sql.id.clone()), // "llama:sql"
//!         messages: vec![ChatMessage::new(Role::User, "List the tables.")],
//!         ..Default::default()
//!     })
//!     .await?;
//! # let _ = answer;
//! match client.unload_adapter("llama", "sql").await {
//!     Err(e) if e.is_conflict() => eprintln!("still in use: {e}"),
//!     other => {
//!         other?;
//!     }
//! }
//! # Ok(()) }
//! ```
use std::path::Path;

use http::Method;
use mlxd_protocol::adapters::{AdapterLoad, AdapterObject, ModelAdapterList, UnloadedAdapter};

use crate::client::Client;
use crate::error::ClientError;

impl Client {
    /// `GET /admin/models/{model}/adapters`: the model's configured adapters and those loaded
    /// at run time. An unknown model is a 404 ([`ClientError::is_not_found`]).
    pub async fn adapters(&self, model: &str) -> Result<ModelAdapterList, ClientError> {
        let path = adapters_path(self, model, None)?;
        self.json(Method::GET, &path, None).await
    }

    /// `POST /admin/models/{model}/adapters`: loads the mlx-lm adapter directory `dir`
    /// (`adapter_config.json` + `adapters.safetensors`; absolute, as the server's engine
    /// reads it) into the model's engine under `name`, starting the engine if it is not
    /// running; the answer has its rank, scale and layers. The adapter is then served as
    /// `<model>:<name>` and kept across engine restarts and reloads. A name already taken is
    /// a 409 ([`ClientError::is_conflict`], code `adapter_exists`); a relative or unreadable
    /// directory a 400; an unknown model a 404.
    pub async fn load_adapter(
        &self,
        model: &str,
        name: &str,
        dir: impl AsRef<Path>,
    ) -> Result<AdapterObject, ClientError> {
        let path = adapters_path(self, model, None)?;
        let dir = dir.as_ref();
        let load = AdapterLoad {
            name: name.to_owned(),
            path: dir
                .to_str()
                .ok_or_else(|| {
                    ClientError::Encode(format!(
                        "the adapter directory {} is not UTF-8",
                        dir.display()
                    ))
                })?
                .to_owned(),
        };
        let body = serde_json::to_vec(&load).map_err(|e| ClientError::Encode(e.to_string()))?;
        self.json(Method::POST, &path, Some(body)).await
    }

    /// `DELETE /admin/models/{model}/adapters/{name}`: unloads an adapter loaded at run time.
    /// While requests in flight run with it, it stays and the answer is a 409
    /// ([`ClientError::is_conflict`], code `adapter_in_use`, the count in the message); a
    /// name not loaded at run time is a 404 ([`ClientError::is_not_found`]); a configured
    /// adapter a 400 (remove it from the configuration instead).
    pub async fn unload_adapter(
        &self,
        model: &str,
        name: &str,
    ) -> Result<UnloadedAdapter, ClientError> {
        let path = adapters_path(self, model, Some(name))?;
        self.json(Method::DELETE, &path, None).await
    }
}

/// The admin route for `model`'s adapters (and `name`'s), for a client of `mlxd`. The names
/// go into the path as they are (mlxd matches it unescaped), so characters a path cannot
/// carry are refused here rather than sent changed.
fn adapters_path(client: &Client, model: &str, name: Option<&str>) -> Result<String, ClientError> {
    if !client.is_http() {
        return Err(ClientError::Config(format!(
            "adapters are loaded at run time through mlxd's admin routes (an HTTP client); \
             this client talks to {}",
            client.target()
        )));
    }
    check_segment("model", model, true)?;
    let mut path = format!("/admin/models/{model}/adapters");
    if let Some(name) = name {
        check_segment("adapter name", name, false)?;
        path.push('/');
        path.push_str(name);
    }
    Ok(path)
}

/// `value` is non-empty and holds only characters a URL path carries unescaped (a model id
/// may hold `/`, as `org/model` does).
fn check_segment(what: &str, value: &str, slash: bool) -> Result<(), ClientError> {
    let fits = |c: char| {
        c.is_ascii_alphanumeric() || "-._~:@!$&'()*+,;=".contains(c) || (slash && c == '/')
    };
    if value.is_empty() || !value.chars().all(fits) {
        return Err(ClientError::Encode(format!(
            "the {what} {value:?} is empty or holds a character a URL path cannot carry \
             unescaped"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_built_from_names_a_url_carries() {
        let client = Client::builder().http("http://127.0.0.1:1").unwrap();
        assert_eq!(
            adapters_path(&client, "org/llama", None).unwrap(),
            "/admin/models/org/llama/adapters"
        );
        assert_eq!(
            adapters_path(&client, "llama", Some("sql-v1.2")).unwrap(),
            "/admin/models/llama/adapters/sql-v1.2"
        );
        for (model, name) in [
            ("", None),
            ("llama?x=1", None),
            ("llama", Some("a/b")),
            ("llama", Some("a b")),
            ("llama", Some("")),
        ] {
            assert!(
                matches!(
                    adapters_path(&client, model, name),
                    Err(ClientError::Encode(_))
                ),
                "{model:?} {name:?}"
            );
        }
        let unix = Client::builder().unix("/tmp/engine.sock").unwrap();
        assert!(matches!(
            adapters_path(&unix, "llama", None),
            Err(ClientError::Config(_))
        ));
    }
}
