//! Tokenization with the byte tokenizer: the chat template's exact layout, loss masks,
//! special tokens typed by users, placeholder spans, and vision/audio placeholder counts.
#![allow(clippy::unwrap_used)]

mod common;

use braid_dataloader::tokenize::{
    ByteTokenizer, ChatTemplate, CompiledTemplate, LossOn, MediaFormat, Message, Part, Role,
    TokenizeError, Tokenizer, audio_tokens, tokenize_sample, vision_tokens,
};

use common::tokenize_util::*;

// ---------------------------------------------------------------- ByteTokenizer

#[test]
fn byte_round_trip_unicode() {
    let t = ByteTokenizer;
    for s in [
        "",
        "hello",
        "Grüße 東京 🎉👩‍👩‍👧 \u{0}\u{FEFF}",
        "<|im_end|> typed",
    ] {
        let ids = t.encode(s).unwrap();
        assert_eq!(ids, bytes(s));
        assert!(ids.iter().all(|&i| i < 256));
        assert_eq!(t.decode(&ids).unwrap(), s);
    }
    assert_eq!(t.vocab_size(), 261);
    assert_eq!(t.token_id("<|im_start|>"), Some(IM_START));
    assert_eq!(t.token_id("<|im_end|>"), Some(IM_END));
    assert_eq!(t.token_id("<|image|>"), Some(IMAGE));
    assert_eq!(t.token_id("<|audio|>"), Some(AUDIO));
    assert_eq!(t.token_id("<|endoftext|>"), Some(EOT));
    assert_eq!(t.token_id("a"), None);
    assert_eq!(
        t.decode(&[IM_START, 104, 105, IM_END]).unwrap(),
        "<|im_start|>hi<|im_end|>"
    );
    // A split UTF-8 sequence decodes lossily, an unknown id is an error.
    assert_eq!(t.decode(&[0xE6, 0x9D]).unwrap(), "\u{FFFD}");
    assert!(matches!(
        t.decode(&[261]),
        Err(TokenizeError::InvalidId { id: 261, .. })
    ));
}

/// The exact layout of a 2-turn chat with an image and a clip, and its loss mask.
#[test]
fn chat_layout_exact_with_byte_tokenizer() {
    let msgs = vec![
        Message::text(Role::System, "Be brief."),
        user(vec![
            text("See "),
            Part::Image(0),
            text(" and hear "),
            Part::Audio(0),
        ]),
        Message::text(Role::Assistant, "A dog."),
        user(vec![text("Sure?")]),
        Message::text(Role::Assistant, "Yes."),
    ];
    let s = tokenize_sample(
        &msgs,
        &ChatTemplate::default(),
        &ByteTokenizer,
        &counts(&[3], &[2]),
    )
    .unwrap();

    let mut ids = Vec::new();
    let mut mask = Vec::new();
    // Appends `part` with mask value `m`; returns where it starts.
    let mut add = |part: Vec<u32>, m: u8| {
        let at = ids.len();
        mask.extend(std::iter::repeat_n(m, part.len()));
        ids.extend(part);
        at
    };
    add(
        [
            vec![IM_START],
            bytes("system\nBe brief."),
            vec![IM_END],
            bytes("\n"),
        ]
        .concat(),
        0,
    );
    add([vec![IM_START], bytes("user\nSee ")].concat(), 0);
    let image_start = add(vec![IMAGE; 3], 0);
    add(bytes(" and hear "), 0);
    let audio_start = add(vec![AUDIO; 2], 0);
    add([vec![IM_END], bytes("\n")].concat(), 0);
    add([vec![IM_START], bytes("assistant\n")].concat(), 0);
    add([bytes("A dog."), vec![IM_END]].concat(), 1);
    add(bytes("\n"), 0);
    add(
        [
            vec![IM_START],
            bytes("user\nSure?"),
            vec![IM_END],
            bytes("\n"),
        ]
        .concat(),
        0,
    );
    add([vec![IM_START], bytes("assistant\n")].concat(), 0);
    add([bytes("Yes."), vec![IM_END]].concat(), 1);
    add(bytes("\n"), 0);

    assert_eq!(s.ids, ids);
    assert_eq!(s.loss_mask, mask);
    assert_eq!(s.image_spans, vec![(image_start, 3)]);
    assert_eq!(s.audio_spans, vec![(audio_start, 2)]);
    assert_eq!(s.text_tokens, ids.len() - 5);
    assert_eq!(s.loss_tokens(), "A dog.".len() + 1 + "Yes.".len() + 1);
    check_invariants(&s, IMAGE, Some(AUDIO));
    assert_eq!(
        ByteTokenizer.decode(&s.ids).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSee <|image|><|image|><|image|> and hear \
         <|audio|><|audio|><|im_end|>\n<|im_start|>assistant\nA dog.<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n\
         <|im_start|>assistant\nYes.<|im_end|>\n"
    );
}

#[test]
fn loss_all_and_bos_eos_and_default_system() {
    let template = ChatTemplate {
        bos: Some("<|endoftext|>".into()),
        eos: Some("<|endoftext|>".into()),
        default_system: Some("Sys.".into()),
        ..ChatTemplate::default()
    };
    let msgs = vec![
        user(vec![Part::Image(0), text("Hi")]),
        Message::text(Role::Assistant, "Yo"),
    ];
    let s = tokenize_sample(&msgs, &template, &ByteTokenizer, &counts(&[2], &[])).unwrap();
    let expect = [
        vec![EOT, IM_START],
        bytes("system\nSys."),
        vec![IM_END],
        bytes("\n"),
        vec![IM_START],
        bytes("user\n"),
        vec![IMAGE, IMAGE],
        bytes("Hi"),
        vec![IM_END],
        bytes("\n"),
        vec![IM_START],
        bytes("assistant\nYo"),
        vec![IM_END],
        bytes("\n"),
        vec![EOT],
    ]
    .concat();
    assert_eq!(s.ids, expect);
    // Assistant-only: "Yo", its <|im_end|>, and the final EOS after an assistant turn.
    let on: Vec<usize> = (0..s.len()).filter(|&i| s.loss_mask[i] == 1).collect();
    let yo = expect.len() - 5;
    assert_eq!(on, vec![yo, yo + 1, yo + 2, expect.len() - 1]);

    // All: every token but the first and the placeholders.
    let all = ChatTemplate {
        loss: LossOn::All,
        ..template.clone()
    };
    let s2 = tokenize_sample(&msgs, &all, &ByteTokenizer, &counts(&[2], &[])).unwrap();
    assert_eq!(s2.ids, s.ids);
    let (start, len) = s2.image_spans[0];
    for (i, &m) in s2.loss_mask.iter().enumerate() {
        let expected = u8::from(i != 0 && !(start..start + len).contains(&i));
        assert_eq!(m, expected, "position {i}");
    }
    // All mode needs no assistant turn.
    let s3 = tokenize_sample(
        &[Message::text(Role::User, "raw text")],
        &all,
        &ByteTokenizer,
        &counts(&[], &[]),
    )
    .unwrap();
    assert_eq!(s3.loss_tokens(), s3.len() - 1);
}

#[test]
fn user_typed_special_tokens_stay_text() {
    // Byte tokenizer: the literal markers are bytes.
    let typed = "<|image|><|im_end|><|audio|>";
    let msgs = vec![
        user(vec![text(typed)]),
        Message::text(Role::Assistant, typed),
    ];
    let s = tokenize_sample(
        &msgs,
        &ChatTemplate::default(),
        &ByteTokenizer,
        &counts(&[], &[]),
    )
    .unwrap();
    assert!(s.image_spans.is_empty() && s.audio_spans.is_empty());
    assert!(!s.ids.contains(&IMAGE) && !s.ids.contains(&AUDIO));
    assert_eq!(
        s.ids.iter().filter(|&&i| i == IM_END).count(),
        2,
        "only the template's turn ends"
    );
    check_invariants(&s, IMAGE, Some(AUDIO));

    // HF tokenizer: a literal "<|image_pad|>" next to a real image gives one span only.
    let tok = tiny();
    let pad = tok.token_id("<|image_pad|>").unwrap();
    let im_end = tok.token_id("<|im_end|>").unwrap();
    let msgs = vec![
        user(vec![
            text("a literal <|image_pad|><|vision_start|> and <|im_end|>"),
            Part::Image(0),
        ]),
        Message::text(Role::Assistant, "<|image_pad|>"),
    ];
    let s = tokenize_sample(&msgs, &ChatTemplate::qwen2_vl(), &tok, &counts(&[5], &[])).unwrap();
    assert_eq!(s.image_spans.len(), 1);
    assert_eq!(s.ids.iter().filter(|&&i| i == pad).count(), 5);
    assert_eq!(s.ids.iter().filter(|&&i| i == im_end).count(), 2);
    check_invariants(&s, pad, None);
}

#[test]
fn text_encoding_to_a_placeholder_id_is_rejected() {
    // `<think>` is a non-special added token: it is matched in text, so using it as a
    // placeholder would let user text forge one.
    let tok = tiny();
    let template = ChatTemplate {
        image: Some(MediaFormat {
            pad: "<think>".into(),
            begin: None,
            end: None,
        }),
        ..ChatTemplate::qwen2_vl()
    };
    let msgs = vec![
        user(vec![text("x <think> y")]),
        Message::text(Role::Assistant, "ok"),
    ];
    let err = tokenize_sample(&msgs, &template, &tok, &counts(&[], &[])).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizeError::ReservedTokenInText {
                message: 0,
                what: "image placeholder",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "message 0: text encodes to the image placeholder token id {}",
            tok.token_id("<think>").unwrap()
        )
    );
    // Same for a default system prompt, caught when the template is compiled.
    let with_system = ChatTemplate {
        default_system: Some("<think>".into()),
        ..template
    };
    let err = CompiledTemplate::new(&with_system, &tok).unwrap_err();
    assert!(
        matches!(&err, TokenizeError::Template(m) if m.starts_with("default_system encodes to the image placeholder")),
        "{err}"
    );
}

#[test]
fn spans_and_markers_with_qwen_layout() {
    let tok = tiny();
    let id = |t: &str| tok.token_id(t).unwrap();
    let (vs, ve, pad, as_, ae, apad) = (
        id("<|vision_start|>"),
        id("<|vision_end|>"),
        id("<|image_pad|>"),
        id("<|audio_start|>"),
        id("<|audio_end|>"),
        id("<|audio_pad|>"),
    );
    let msgs = vec![
        user(vec![
            Part::Image(0),
            Part::Audio(0),
            text("and"),
            Part::Image(1),
        ]),
        Message::text(Role::Assistant, "fine"),
        user(vec![Part::Audio(1)]),
        Message::text(Role::Assistant, "ok"),
    ];
    let c = counts(&[4, 1], &[3, 2]);
    let s = tokenize_sample(&msgs, &ChatTemplate::qwen2_vl(), &tok, &c).unwrap();
    check_invariants(&s, pad, Some(apad));
    for (spans, (b, e), n) in [
        (&s.image_spans, (vs, ve), &c.images),
        (&s.audio_spans, (as_, ae), &c.audio),
    ] {
        assert_eq!(spans.len(), n.len());
        for (k, &(start, len)) in spans.iter().enumerate() {
            assert_eq!(len, n[k]);
            assert_eq!(s.ids[start - 1], b);
            assert_eq!(s.ids[start + len], e);
        }
    }
    // Spans in item order are in position order.
    assert!(s.image_spans[0].0 < s.audio_spans[0].0 && s.audio_spans[0].0 < s.image_spans[1].0);
    assert!(s.image_spans[1].0 < s.audio_spans[1].0);
    assert_eq!(s.text_tokens, s.len() - 10);
}

// ---------------------------------------------------------------- placeholder counts

#[test]
fn vision_token_counts() {
    assert_eq!(vision_tokens(224, 224, 14, 1, false).unwrap(), 256); // CLIP ViT-L/14-224
    assert_eq!(vision_tokens(336, 336, 14, 1, false).unwrap(), 576); // LLaVA-1.5
    assert_eq!(vision_tokens(336, 336, 14, 1, true).unwrap(), 577);
    assert_eq!(vision_tokens(448, 224, 14, 2, false).unwrap(), 16 * 8); // Qwen2-VL 2x2 merge
    assert_eq!(vision_tokens(384, 384, 16, 1, false).unwrap(), 576); // SigLIP-384/16
    for (h, w, p, m) in [
        (225, 224, 14, 1),
        (224, 224, 14, 3),
        (0, 224, 14, 1),
        (224, 224, 0, 1),
        (28, 28, 14, 0),
    ] {
        let e = vision_tokens(h, w, p, m, false).unwrap_err();
        assert!(
            matches!(e, TokenizeError::Geometry { .. }),
            "{h} {w} {p} {m}: {e}"
        );
    }
    assert!(vision_tokens(usize::MAX, usize::MAX, 1, 1, false).is_err());
}

#[test]
fn audio_token_counts() {
    // Reference: a kernel-3, padding-1 convolution of stride s keeps floor((F - 1) / s) + 1
    // frames, then groups of `pool` frames, the last one padded.
    for f in 1usize..400 {
        for s in 1..4 {
            for pool in 1..6 {
                let conv = (f + 2 - 3) / s + 1;
                let expect: usize = conv / pool + usize::from(conv % pool != 0);
                assert_eq!(audio_tokens(f, s, pool).unwrap(), expect, "{f} {s} {pool}");
            }
        }
    }
    assert_eq!(audio_tokens(3000, 2, 1).unwrap(), 1500); // Whisper, 30 s
    assert_eq!(audio_tokens(3000, 2, 4).unwrap(), 375);
    assert!(audio_tokens(0, 2, 1).is_err());
    assert!(audio_tokens(10, 0, 1).is_err());
    assert!(audio_tokens(10, 2, 0).is_err());
}
