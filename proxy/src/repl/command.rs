//! The chat's slash commands (`/bye`, `/set temperature 0.7`, ...) and the settings they
//! change. Pure: parsing and formatting only, so every rule is unit-tested.

use mlxd_client::{ChatCompletionRequest, ChatMessage, Role};

/// A line that starts with `/`, parsed.
#[derive(Debug, Clone, PartialEq)]
pub enum ChatCommand {
    /// `/bye`: leave the chat.
    Bye,
    /// `/?` or `/help`.
    Help,
    /// `/clear`: forget the conversation (the settings stay).
    Clear,
    /// `/show`: the model and the settings.
    Show,
    /// `/set NAME VALUE`.
    Set(Setting),
}

/// One setting `/set` changes.
#[derive(Debug, Clone, PartialEq)]
pub enum Setting {
    System(String),
    Temperature(f64),
    TopP(f64),
    TopK(i64),
    Seed(i64),
    MaxTokens(u32),
    Verbose(bool),
}

/// What `/?` prints.
pub const HELP: &str = "\
Commands:
  /set system TEXT        the system prompt (starts a new conversation)
  /set temperature X      sampling temperature, 0 = greedy
  /set top_p X            nucleus sampling mass, in (0, 1]
  /set top_k N            keep the N most likely tokens
  /set seed N             seed for repeatable sampling
  /set max_tokens N       most tokens per answer
  /set verbose | quiet    token counts and rates after each answer, or not
  /show                   the model and these settings
  /clear                  forget the conversation
  /bye                    leave (Ctrl-D on an empty line too)
  /? or /help             this help

Start a message with \"\"\" to write several lines; end it with \"\"\".
Ctrl-C stops an answer and keeps the chat.
";

/// `/set`'s names, for its error messages.
const SETTINGS: &str = "system, temperature, top_p, top_k, seed, max_tokens, verbose, quiet";

/// `None` when `line` is not a command (it does not start with `/`); otherwise the command, or
/// a message saying what is wrong with it.
pub fn parse(line: &str) -> Option<Result<ChatCommand, String>> {
    let line = line.trim();
    let rest = line.strip_prefix('/')?;
    let (name, args) = match rest.split_once(char::is_whitespace) {
        Some((n, a)) => (n, a.trim()),
        None => (rest, ""),
    };
    let no_args = |c: ChatCommand| {
        if args.is_empty() {
            Ok(c)
        } else {
            Err(format!("/{name} takes no arguments, got {args:?}"))
        }
    };
    Some(match name {
        "bye" | "exit" | "quit" => no_args(ChatCommand::Bye),
        "?" | "help" => Ok(ChatCommand::Help),
        "clear" => no_args(ChatCommand::Clear),
        "show" => Ok(ChatCommand::Show),
        "set" => parse_set(args).map(ChatCommand::Set),
        _ => Err(format!("unknown command /{name}; /? lists the commands")),
    })
}

fn parse_set(args: &str) -> Result<Setting, String> {
    let (name, value) = match args.split_once(char::is_whitespace) {
        Some((n, v)) => (n, v.trim()),
        None => (args, ""),
    };
    let needs = |what: &str| format!("/set {name} needs {what}, got {value:?}");
    let float = |ok: fn(f64) -> bool, what: &str| {
        value
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && ok(*v))
            .ok_or_else(|| needs(what))
    };
    let int = |min: i64, what: &str| {
        value
            .parse::<i64>()
            .ok()
            .filter(|v| *v >= min)
            .ok_or_else(|| needs(what))
    };
    match name {
        "" => Err(format!("/set needs a setting: {SETTINGS}")),
        "system" if value.is_empty() => Err("/set system needs the prompt's text".into()),
        "system" => Ok(Setting::System(value.to_string())),
        "temperature" => float(|v| v >= 0.0, "a number of at least 0").map(Setting::Temperature),
        "top_p" => float(|v| v > 0.0 && v <= 1.0, "a number in (0, 1]").map(Setting::TopP),
        "top_k" => int(0, "a whole number of at least 0").map(Setting::TopK),
        "seed" => int(0, "a whole number of at least 0").map(Setting::Seed),
        "max_tokens" => value
            .parse::<u32>()
            .ok()
            .filter(|v| *v >= 1)
            .map(Setting::MaxTokens)
            .ok_or_else(|| needs("a whole number of at least 1")),
        "verbose" | "quiet" if !value.is_empty() => {
            Err(format!("/set {name} takes no value, got {value:?}"))
        }
        "verbose" => Ok(Setting::Verbose(true)),
        "quiet" => Ok(Setting::Verbose(false)),
        _ => Err(format!("unknown setting {name:?}; /set takes {SETTINGS}")),
    }
}

/// What a chat sends with each message, changed by `/set`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatSettings {
    pub system: Option<String>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub max_tokens: u32,
    pub verbose: bool,
}

impl ChatSettings {
    /// Changes one setting; a new system prompt starts a new conversation (returns true then).
    pub fn apply(&mut self, setting: Setting) -> bool {
        match setting {
            Setting::System(s) => {
                self.system = Some(s);
                return true;
            }
            Setting::Temperature(v) => self.temperature = Some(v),
            Setting::TopP(v) => self.top_p = Some(v),
            Setting::TopK(v) => self.top_k = Some(v),
            Setting::Seed(v) => self.seed = Some(v),
            Setting::MaxTokens(v) => self.max_tokens = v,
            Setting::Verbose(v) => self.verbose = v,
        }
        false
    }

    /// What `/show` prints: the model and every setting (`server default` where unset).
    pub fn show(&self, model: &str, server: &str) -> String {
        let or_default = |v: Option<String>| v.unwrap_or_else(|| "server default".into());
        format!(
            "model        {model}\n\
             server       {server}\n\
             system       {}\n\
             temperature  {}\n\
             top_p        {}\n\
             top_k        {}\n\
             seed         {}\n\
             max_tokens   {}\n\
             verbose      {}\n",
            self.system.as_deref().unwrap_or("(none)"),
            or_default(self.temperature.map(|v| v.to_string())),
            or_default(self.top_p.map(|v| v.to_string())),
            or_default(self.top_k.map(|v| v.to_string())),
            or_default(self.seed.map(|v| v.to_string())),
            self.max_tokens,
            if self.verbose { "on" } else { "off" },
        )
    }

    /// The request for the conversation `history` (user and assistant turns) with these
    /// settings; no model means the server's default.
    pub fn request(&self, model: Option<&str>, history: &[ChatMessage]) -> ChatCompletionRequest {
        let mut messages = Vec::with_capacity(history.len() + 1);
        if let Some(s) = &self.system {
            messages.push(ChatMessage::new(Role::System, s.clone()));
        }
        messages.extend_from_slice(history);
        let mut request = ChatCompletionRequest {
            model: model.map(str::to_string),
            messages,
            ..Default::default()
        };
        let p = &mut request.params;
        p.max_tokens = Some(i64::from(self.max_tokens));
        p.temperature = self.temperature;
        p.top_p = self.top_p;
        p.top_k = self.top_k;
        p.seed = self.seed;
        request
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(line: &str) -> ChatCommand {
        parse(line).unwrap().unwrap()
    }

    fn err(line: &str) -> String {
        parse(line).unwrap().unwrap_err()
    }

    #[test]
    fn plain_text_is_not_a_command() {
        assert_eq!(parse("hello /bye"), None);
        assert_eq!(parse(""), None);
        assert_eq!(parse("  \"\"\""), None);
    }

    #[test]
    fn commands() {
        assert_eq!(ok("/bye"), ChatCommand::Bye);
        assert_eq!(ok("  /bye  "), ChatCommand::Bye);
        assert_eq!(ok("/?"), ChatCommand::Help);
        assert_eq!(ok("/help"), ChatCommand::Help);
        assert_eq!(ok("/clear"), ChatCommand::Clear);
        assert_eq!(ok("/show"), ChatCommand::Show);
        assert!(err("/bye now").contains("takes no arguments"));
        assert!(err("/nope").contains("unknown command /nope"));
    }

    #[test]
    fn set_commands_and_their_errors() {
        assert_eq!(
            ok("/set system You are terse.  "),
            ChatCommand::Set(Setting::System("You are terse.".into()))
        );
        assert_eq!(
            ok("/set temperature 0.7"),
            ChatCommand::Set(Setting::Temperature(0.7))
        );
        assert_eq!(ok("/set top_p 1"), ChatCommand::Set(Setting::TopP(1.0)));
        assert_eq!(ok("/set top_k 40"), ChatCommand::Set(Setting::TopK(40)));
        assert_eq!(ok("/set seed 7"), ChatCommand::Set(Setting::Seed(7)));
        assert_eq!(
            ok("/set max_tokens 16"),
            ChatCommand::Set(Setting::MaxTokens(16))
        );
        assert_eq!(ok("/set verbose"), ChatCommand::Set(Setting::Verbose(true)));
        assert_eq!(ok("/set quiet"), ChatCommand::Set(Setting::Verbose(false)));
        let e = err("/set temperature hot");
        assert!(e.contains("at least 0") && e.contains("\"hot\""), "{e}");
        assert!(err("/set temperature -1").contains("at least 0"));
        assert!(err("/set temperature NaN").contains("at least 0"));
        assert!(err("/set top_p 0").contains("(0, 1]"));
        assert!(err("/set top_p 1.5").contains("(0, 1]"));
        assert!(err("/set top_k 2.5").contains("whole number"));
        assert!(err("/set max_tokens 0").contains("at least 1"));
        assert!(err("/set system").contains("text"));
        assert!(err("/set").contains("temperature"));
        let e = err("/set colour blue");
        assert!(e.contains("\"colour\"") && e.contains("max_tokens"), "{e}");
        assert!(err("/set verbose please").contains("no value"));
    }

    #[test]
    fn settings_shape_the_request() {
        let mut s = ChatSettings {
            max_tokens: 64,
            ..Default::default()
        };
        assert!(!s.apply(Setting::Temperature(0.5)));
        assert!(!s.apply(Setting::Seed(3)));
        assert!(s.apply(Setting::System("be brief".into())));
        let history = [ChatMessage::new(Role::User, "hi")];
        let r = s.request(Some("m"), &history);
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.messages.len(), 2);
        assert_eq!(r.messages[0].role, Role::System);
        assert_eq!(r.params.temperature, Some(0.5));
        assert_eq!(r.params.seed, Some(3));
        assert_eq!(r.params.max_tokens, Some(64));
        assert_eq!(r.params.top_p, None);
        assert_eq!(s.request(None, &history).model, None);
        let shown = s.show("m", "http://h:1");
        assert!(shown.contains("temperature  0.5"), "{shown}");
        assert!(shown.contains("top_p        server default"), "{shown}");
        assert!(shown.contains("system       be brief"), "{shown}");
    }
}
