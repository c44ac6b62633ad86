//! Constrained decoding: a request's [`Constraint`] compiled by llguidance
//! (the grammar engine vLLM, SGLang and llama.cpp use) against the model's
//! tokenizer, and each step's token mask.
//!
//! [`Grammars`] belongs to a model: the token trie of its vocabulary (built on
//! the first constrained request; each token's bytes read from the
//! tokenizer's byte-level alphabet or its `<0xXX>` byte-fallback tokens, the
//! model's end tokens as the grammar's end), and the compiled grammars of
//! recent constraints, so that a batch of thousands of requests under one
//! schema compiles it once (and each token's bytes, as log-probabilities
//! report them); requests clone a compiled [`Matcher`], sharing its
//! lexer's states. [`Guide`] is one request's matcher and its mask for the
//! next token: computed before the step's forward pass where the engine can
//! (on a thread of its own, beside the pass), or when sampling asks. A mask
//! keeps within [`lorry_protocol::constraint::limits`]; one that runs out of
//! them ends its request with `constraint_too_complex`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use lorry_protocol::constraint::{self, Constraint};
use tokenizers::{DecoderWrapper, Tokenizer};

use crate::input::InputError;
use crate::{EngineError, ErrorCode};

/// Compiled grammars kept per model.
const COMPILED_ENTRIES: usize = 64;

/// A model's grammar compiler and its recent grammars, and its vocabulary spelled as bytes.
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    stop_ids: Vec<u32>,
    vocab_size: usize,
    factory: OnceLock<Result<ParserFactory, String>>,
    /// Each token's bytes, for log-probabilities; read on first use.
    spelled: OnceLock<Vec<Vec<u8>>>,
    /// Most recently used last.
    compiled: Mutex<Vec<(String, Matcher)>>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl Grammars {
    /// For a model whose logits have `vocab_size` entries and whose generation ends at `stop_ids`.
    pub fn new(tokenizer: Arc<Tokenizer>, stop_ids: Vec<u32>, vocab_size: usize) -> Self {
        Grammars {
            tokenizer,
            stop_ids,
            vocab_size,
            factory: OnceLock::new(),
            spelled: OnceLock::new(),
            compiled: Mutex::new(Vec::new()),
        }
    }

    /// Each token's bytes as log-probabilities report them (a special
    /// token's name for it); read from the tokenizer on first use.
    pub fn token_bytes(&self) -> &[Vec<u8>] {
        self.spelled.get_or_init(|| {
            let n = self.vocab_size.max(self.tokenizer.get_vocab_size(true));
            spelled(&self.tokenizer, &self.stop_ids, n)
        })
    }

    fn factory(&self) -> Result<&ParserFactory, String> {
        self.factory
            .get_or_init(|| {
                let env = token_env(&self.tokenizer, &self.stop_ids, self.vocab_size)?;
                let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
                *factory.limits_mut() = constraint::limits();
                factory.quiet();
                Ok(factory)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// A fresh guide for one request.
    pub fn guide(&self, constraint: &Constraint) -> Result<Guide, EngineError> {
        let key = constraint.key();
        let refused =
            |code: ErrorCode, message: String| EngineError::Input(InputError::new(code, "response_format", message));
        {
            let mut compiled = self.compiled.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(at) = compiled.iter().position(|(k, _)| *k == key) {
                let entry = compiled.remove(at);
                let matcher = entry.1.clone();
                compiled.push(entry);
                return Ok(Guide::new(matcher));
            }
        }
        let factory = self.factory().map_err(|e| {
            refused(
                ErrorCode::UnsupportedParameter,
                format!("this model's tokenizer cannot be constrained: {e}"),
            )
        })?;
        let unservable = |e: &dyn std::fmt::Display| {
            let reason = constraint::first_line(&e.to_string());
            refused(
                constraint.invalid_code(),
                format!("the constraint cannot be served: {reason}"),
            )
        };
        let grammar: TopLevelGrammar = constraint.grammar();
        let parser = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| factory.create_parser(grammar))) {
            Ok(Ok(parser)) => parser,
            Ok(Err(error)) => return Err(unservable(&error)),
            Err(_) => return Err(unservable(&"the grammar compiler failed")),
        };
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(unservable(&error));
        }
        let mut compiled = self.compiled.lock().unwrap_or_else(|e| e.into_inner());
        if compiled.len() >= COMPILED_ENTRIES {
            compiled.remove(0);
        }
        compiled.push((key, matcher.clone()));
        Ok(Guide::new(matcher))
    }
}

/// One request's matcher, and the mask for its next token once computed.
pub struct Guide {
    matcher: Matcher,
    mask: Option<Result<SimpleVob, String>>,
}

impl Clone for Guide {
    fn clone(&self) -> Self {
        Guide {
            matcher: self.matcher.deep_clone(),
            mask: self.mask.clone(),
        }
    }
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide")
            .field("stopped", &self.matcher.is_stopped())
            .field("mask_ready", &self.mask.is_some())
            .finish()
    }
}

impl Guide {
    fn new(matcher: Matcher) -> Self {
        Guide { matcher, mask: None }
    }

    /// Compute the next token's mask now, if it is not known yet.
    pub(crate) fn prepare(&mut self) {
        if self.mask.is_none() {
            self.mask = Some(self.matcher.compute_mask().map_err(|e| e.to_string()));
        }
    }

    /// Whether the next token's mask is known.
    pub(crate) fn is_prepared(&self) -> bool {
        self.mask.is_some()
    }

    /// `logits` with every token the grammar does not allow next set to −∞.
    pub(crate) fn masked(&mut self, logits: &[f32]) -> Result<Vec<f32>, EngineError> {
        self.prepare();
        let mask = match self.mask.as_ref().expect("prepared") {
            Ok(mask) => mask,
            Err(error) => return Err(too_complex(error)),
        };
        let mut out = vec![f32::NEG_INFINITY; logits.len()];
        let mut any = false;
        for (i, (o, &x)) in out.iter_mut().zip(logits).enumerate() {
            if mask.is_allowed(i as TokenId) {
                *o = x;
                any = true;
            }
        }
        if !any {
            return Err(too_complex("no token can continue the output"));
        }
        Ok(out)
    }

    /// Advance past `token`, which the mask allowed.
    pub(crate) fn consume(&mut self, token: u32) -> Result<(), EngineError> {
        self.mask = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| too_complex(&e.to_string()))
    }

    /// Undo the last `tokens` consumed.
    pub(crate) fn rollback(&mut self, tokens: usize) -> Result<(), EngineError> {
        if tokens == 0 {
            return Ok(());
        }
        self.mask = None;
        self.matcher.rollback(tokens).map_err(|e| too_complex(&e.to_string()))
    }

    /// How many of `tokens`, in order, the grammar would take from here.
    pub(crate) fn admissible(&mut self, tokens: &[u32]) -> usize {
        self.matcher.validate_tokens(tokens).unwrap_or(0)
    }

    /// Whether the grammar is complete and takes nothing more.
    pub(crate) fn is_done(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }
}

fn too_complex(reason: &str) -> EngineError {
    EngineError::Input(InputError::new(
        ErrorCode::ConstraintTooComplex,
        "response_format",
        format!(
            "the output's constraint could not be followed: {}",
            constraint::first_line(reason)
        ),
    ))
}

/// The token environment llguidance compiles against: each token's bytes
/// and the model's end tokens.
struct ModelTokens {
    tokenizer: Arc<Tokenizer>,
    trie: TokTrie,
}

impl TokenizerEnv for ModelTokens {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(bytes, |text| {
            self.tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

/// How a tokenizer spells bytes in its tokens.
#[derive(Default)]
struct Spelling {
    byte_level: bool,
    byte_fallback: bool,
    /// The character that stands for a space (`▁` in SentencePiece vocabularies).
    space: Option<char>,
}

fn spelling(decoder: &DecoderWrapper, found: &mut Spelling) {
    match decoder {
        DecoderWrapper::ByteLevel(_) => found.byte_level = true,
        DecoderWrapper::ByteFallback(_) => found.byte_fallback = true,
        DecoderWrapper::Metaspace(m) => found.space = Some(m.get_replacement()),
        DecoderWrapper::Replace(r) if r.content == " " => {
            // The pattern is private; its serialised form names it.
            let pattern = serde_json::to_value(r).ok();
            let from = pattern.as_ref().and_then(|v| v["pattern"]["String"].as_str());
            if let Some(c) = from
                .and_then(|s| s.chars().next())
                .filter(|_| from.is_some_and(|s| s.chars().count() == 1))
            {
                found.space = Some(c);
            }
        }
        DecoderWrapper::Sequence(sequence) => {
            for d in sequence.get_decoders() {
                spelling(d, found);
            }
        }
        _ => {}
    }
}

/// GPT-2's map of printable characters back to the bytes they stand for.
fn byte_level_alphabet() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut map = HashMap::new();
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        if printable(b) {
            map.insert(b as char, b);
        } else {
            map.insert(char::from_u32(next).expect("a valid character"), b);
            next += 1;
        }
    }
    map
}

/// One token of a vocabulary as bytes.
enum Word {
    /// What the token stands for in text.
    Bytes(Vec<u8>),
    /// A special token (an end token, a control token), by its name.
    Special(String),
}

/// Each token of a vocabulary of `n` as bytes, read from the tokenizer's
/// byte-level alphabet or byte-fallback tokens; `Err` where the decoder
/// spells tokens neither way.
fn words(tokenizer: &Tokenizer, stop_ids: &[u32], n: usize) -> Result<Vec<Word>, String> {
    let mut found = Spelling::default();
    if let Some(decoder) = tokenizer.get_decoder() {
        spelling(decoder, &mut found);
    }
    if !found.byte_level && !found.byte_fallback {
        return Err("its decoder spells tokens neither as byte-level text nor with byte fallback".into());
    }
    let added = tokenizer.get_added_tokens_decoder();
    let specials: HashSet<u32> = added
        .iter()
        .filter(|(_, t)| t.special || (t.content.starts_with('<') && t.content.ends_with('>')))
        .map(|(&id, _)| id)
        .collect();
    let alphabet = byte_level_alphabet();
    let mut words = Vec::with_capacity(n);
    for id in 0..n as u32 {
        let word = match tokenizer.id_to_token(id) {
            None => Word::Special(format!("<[{id}]>")),
            Some(name) if specials.contains(&id) || stop_ids.contains(&id) => Word::Special(name),
            Some(name) if added.get(&id).is_some() => Word::Bytes(name.into_bytes()),
            Some(name) if found.byte_level => match name.chars().map(|c| alphabet.get(&c).copied()).collect() {
                Some(bytes) => Word::Bytes(bytes),
                None => Word::Special(name),
            },
            Some(name) => match byte_token(&name) {
                Some(byte) => Word::Bytes(vec![byte]),
                None => match found.space {
                    Some(space) => Word::Bytes(name.replace(space, " ").into_bytes()),
                    None => Word::Bytes(name.into_bytes()),
                },
            },
        };
        words.push(word);
    }
    Ok(words)
}

/// Each token's bytes as log-probabilities report them: what it stands for
/// in text, a special token's name; for a tokenizer [`words`] cannot read,
/// each token decoded alone.
fn spelled(tokenizer: &Tokenizer, stop_ids: &[u32], n: usize) -> Vec<Vec<u8>> {
    match words(tokenizer, stop_ids, n) {
        Ok(words) => words
            .into_iter()
            .map(|word| match word {
                Word::Bytes(bytes) => bytes,
                Word::Special(name) => name.into_bytes(),
            })
            .collect(),
        Err(_) => (0..n as u32)
            .map(|id| tokenizer.decode(&[id], false).unwrap_or_default().into_bytes())
            .collect(),
    }
}

/// Each token's bytes, special tokens marked as llguidance expects.
fn token_env(tokenizer: &Arc<Tokenizer>, stop_ids: &[u32], vocab_size: usize) -> Result<TokEnv, String> {
    let n = vocab_size.max(tokenizer.get_vocab_size(true));
    let words: Vec<Vec<u8>> = words(tokenizer, stop_ids, n)?
        .into_iter()
        .map(|word| match word {
            Word::Bytes(bytes) => bytes,
            Word::Special(name) => {
                let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                bytes.extend_from_slice(name.as_bytes());
                bytes
            }
        })
        .collect();
    let eos = stop_ids.first().copied().unwrap_or(0);
    let info = TokRxInfo::new(n as u32, eos);
    let mut trie = TokTrie::from(&info, &words);
    if stop_ids.len() > 1 {
        trie = trie.with_eos_tokens(stop_ids);
    }
    Ok(Arc::new(ModelTokens {
        tokenizer: Arc::clone(tokenizer),
        trie,
    }))
}

/// `<0x41>` → 0x41: SentencePiece's byte-fallback tokens.
fn byte_token(name: &str) -> Option<u8> {
    let hex = name.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_fallback_tokens_read_as_their_byte() {
        assert_eq!(byte_token("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_token("<0xZZ>"), None);
        assert_eq!(byte_token("<s>"), None);
        let alphabet = byte_level_alphabet();
        assert_eq!(alphabet.len(), 256);
        assert_eq!(alphabet[&'Ġ'], b' ');
        assert_eq!(alphabet[&'a'], b'a');
    }
}
