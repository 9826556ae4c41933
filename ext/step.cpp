#include "step.h"

#include "json-schema-to-grammar.h"
#include "json.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>

namespace engine {

namespace {

StepError to_step_error(int32_t seq, const std::exception & e) {
    if (const auto * err = dynamic_cast<const Error *>(&e)) {
        return {seq, error_kind_name(err->kind), err->what()};
    }
    return {seq, "SessionError", e.what()};
}

}  // namespace

common_sampler_ptr make_sampler(const Model & model, const SamplerParams & sp) {
    auto bad = [](const std::string & why) { fail(ErrorKind::InvalidArgument, why); };
    if (!(sp.temperature >= 0.0f) || !std::isfinite(sp.temperature)) bad("temperature must be >= 0");
    if (sp.top_k < 0) bad("top_k must be >= 0");
    if (!(sp.top_p > 0.0f && sp.top_p <= 1.0f)) bad("top_p must be in (0, 1]");
    if (!(sp.min_p >= 0.0f && sp.min_p <= 1.0f)) bad("min_p must be in [0, 1]");
    if (sp.penalty_last_n < -1) bad("penalty_last_n must be >= -1");
    if (!std::isfinite(sp.repetition_penalty) || sp.repetition_penalty <= 0.0f) bad("repetition_penalty must be > 0");
    if (!std::isfinite(sp.presence_penalty) || !std::isfinite(sp.frequency_penalty)) bad("penalties must be finite");
    if (!sp.grammar.empty() && !sp.json_schema.empty()) bad("give a grammar or a JSON schema, not both");

    common_params_sampling p;
    p.seed = sp.seed;
    p.temp = sp.temperature;
    p.top_k = sp.top_k;
    p.top_p = sp.top_p;
    p.min_p = sp.min_p;
    p.penalty_last_n = sp.penalty_last_n;
    p.penalty_repeat = sp.repetition_penalty;
    p.penalty_present = sp.presence_penalty;
    p.penalty_freq = sp.frequency_penalty;
    p.no_perf = true;
    if (sp.ignore_eos) {
        for (int32_t t : model.info().eog_tokens) {
            p.logit_bias.push_back({t, -std::numeric_limits<float>::infinity()});
        }
    }
    std::string grammar = sp.grammar;
    if (!sp.json_schema.empty()) {
        try {
            grammar = json_schema_to_grammar(common_json::parse(sp.json_schema));
        } catch (const std::exception & e) {
            bad(std::string("invalid JSON schema: ") + e.what());
        }
    }
    if (!grammar.empty()) {
        p.grammar = common_grammar(COMMON_GRAMMAR_TYPE_USER, grammar);
    }
    common_sampler * s = nullptr;
    try {
        s = common_sampler_init(model.get(), p);
    } catch (const std::exception & e) {
        bad(std::string("invalid sampling parameters: ") + e.what());
    }
    if (s == nullptr) bad(grammar.empty() ? "could not create the sampler" : "invalid grammar");
    return common_sampler_ptr(s);
}

StepRunner::StepRunner(std::shared_ptr<SpecSession> session) : session_(std::move(session)) {
    samplers_.resize(session_->config().n_seq);
    plain_greedy_.assign(session_->config().n_seq, false);
    ignore_eos_.assign(session_->config().n_seq, false);
}

static bool is_plain_greedy(const SamplerParams & p) {
    return p.temperature <= 0.0f && p.repetition_penalty == 1.0f && p.presence_penalty == 0.0f &&
           p.frequency_penalty == 0.0f && p.grammar.empty() && p.json_schema.empty();
}

std::vector<llama_token> StepRunner::verify(int32_t seq, const std::vector<int> & idxs,
                                            const std::vector<llama_token> & draft) {
    Context & target = *session_->target();
    if (!plain_greedy_[seq]) {
        return common_sampler_sample_and_accept_n(samplers_[seq].get(), target.get(), idxs, draft);
    }
    // same result as the greedy sampler chain: argmax (EOG tokens excluded under ignore_eos)
    const ModelInfo & info = target.model()->info();
    const int32_t n_vocab = info.n_vocab;
    std::vector<llama_token> out;
    for (size_t i = 0; i < idxs.size(); ++i) {
        const float * row = llama_get_logits_ith(target.get(), idxs[i]);
        llama_token best = 0;
        float best_v = -std::numeric_limits<float>::infinity();
        for (llama_token t = 0; t < n_vocab; ++t) {
            if (row[t] > best_v) {
                best_v = row[t];
                best = t;
            }
        }
        if (ignore_eos_[seq] && std::find(info.eog_tokens.begin(), info.eog_tokens.end(), best) != info.eog_tokens.end()) {
            best_v = -std::numeric_limits<float>::infinity();
            for (llama_token t = 0; t < n_vocab; ++t) {
                if (row[t] > best_v && std::find(info.eog_tokens.begin(), info.eog_tokens.end(), t) == info.eog_tokens.end()) {
                    best_v = row[t];
                    best = t;
                }
            }
        }
        out.push_back(best);
        const bool eog = !ignore_eos_[seq] &&
                         std::find(info.eog_tokens.begin(), info.eog_tokens.end(), best) != info.eog_tokens.end();
        // as upstream: no draft is accepted past an end-of-generation token
        if (i == draft.size() || draft[i] != best || eog) break;
    }
    return out;
}

void StepRunner::clear_slot(int32_t seq) {
    SpecSession & s = *session_;
    s.clear_target_kv(seq, -1, -1);
    if (s.draft_context()) {
        s.clear_draft_kv(seq, -1, -1);
    }
    samplers_[seq].reset();
}

StepResult StepRunner::run(const StepPlan & plan) {
    try {
        return run_unchecked(plan);
    } catch (...) {
        // whatever failed, leave every sequence quiescent so the next step can run
        for (int32_t seq = 0; seq < static_cast<int32_t>(session_->config().n_seq); ++seq) {
            if (session_->pending(seq)) session_->accept(seq, 0);
        }
        throw;
    }
}

StepResult StepRunner::run_unchecked(const StepPlan & plan) {
    const int64_t t_start = now_us();
    SpecSession & s = *session_;
    Context & target = *s.target();
    const Model & model = *target.model();
    const int32_t n_seq = static_cast<int32_t>(s.config().n_seq);
    StepResult result;
    std::vector<bool> failed(n_seq, false);
    auto fail_seq = [&](int32_t seq, const std::exception & e) {
        result.errors.push_back(to_step_error(seq, e));
        failed[seq] = true;
    };
    auto valid_seq = [&](int32_t seq) {
        if (seq < 0 || seq >= n_seq) fail_bad_seq(seq, n_seq);
    };

    // --- boundary work: every sequence is quiescent here -----------------------------
    s.require_quiescent();
    for (int32_t seq : plan.captures) {
        try {
            valid_seq(seq);
            StepCapture c;
            c.seq = seq;
            c.spec = s.speculative_state(seq);
            c.target = target.state_seq_get(seq, 0);
            if (s.draft_context()) c.draft = s.draft_context()->state_seq_get(seq, 0);
            result.captures.push_back(std::move(c));
        } catch (const std::exception & e) {
            result.errors.push_back(to_step_error(seq, e));
        }
    }
    for (int32_t seq : plan.clears) {
        valid_seq(seq);
        clear_slot(seq);
    }
    for (const StepRestore & r : plan.restores) {
        valid_seq(r.seq);
        try {
            clear_slot(r.seq);
            target.state_seq_set(r.target, r.seq, 0);
            if (s.draft_context()) s.draft_context()->state_seq_set(r.draft, r.seq, 0);
            s.restore_speculative_state(r.seq, r.spec);
        } catch (const std::exception & e) {
            clear_slot(r.seq);
            fail_seq(r.seq, e);
        }
    }
    for (const StepConfigure & c : plan.configures) {
        valid_seq(c.seq);
        if (failed[c.seq]) continue;
        try {
            common_sampler_ptr smpl = make_sampler(model, c.params);
            for (int32_t t : c.replay_prompt) common_sampler_accept(smpl.get(), t, false);
            for (int32_t t : c.replay_generated) common_sampler_accept(smpl.get(), t, true);
            samplers_[c.seq] = std::move(smpl);
            plain_greedy_[c.seq] = is_plain_greedy(c.params);
            ignore_eos_[c.seq] = c.params.ignore_eos;
        } catch (const std::exception & e) {
            fail_seq(c.seq, e);
        }
    }

    // --- validate the work, then ONE draft call for every drafting sequence ----------
    const uint32_t n_batch = target.params().n_batch;
    std::vector<const StepWork *> work;
    for (const StepWork & w : plan.work) {
        valid_seq(w.seq);
        if (failed[w.seq]) continue;
        try {
            if (w.tokens.empty()) fail(ErrorKind::InvalidArgument, "a work item needs at least one token");
            model.check_tokens(w.tokens, "step");
            if (w.sample && !samplers_[w.seq]) fail(ErrorKind::InvalidArgument, "no sampler configured for the sequence");
            if (w.n_draft > 0 && (w.tokens.size() != 1 || !w.sample)) {
                // drafting continues from a token whose predecessors the drafter has seen
                fail(ErrorKind::InvalidArgument, "only a single-token sampling item may draft");
            }
            if (w.tokens.size() + std::max(w.n_draft, 0) > n_batch) {
                fail(ErrorKind::InvalidArgument, "a work item exceeds n_batch");
            }
            work.push_back(&w);
        } catch (const std::exception & e) {
            fail_seq(w.seq, e);
        }
    }
    // llama.cpp splits a multi-stream batch into one micro-batch per run of ascending
    // sequence ids: out-of-order sequences cost a full forward pass each (3x slower at 4)
    std::stable_sort(work.begin(), work.end(),
                     [](const StepWork * a, const StepWork * b) { return a->seq < b->seq; });
    std::vector<DraftRequest> requests;
    for (auto it = work.begin(); it != work.end();) {
        const StepWork * w = *it;
        if (w->sample && w->n_draft > 0) {
            DraftRequest r{w->seq, w->pos0 + static_cast<int32_t>(w->tokens.size()) - 1, w->tokens.back(), w->n_draft};
            try {
                s.check_draft_request(r);  // one bad request must not fail the others' draft call
            } catch (const std::exception & e) {
                fail_seq(w->seq, e);
                it = work.erase(it);
                continue;
            }
            requests.push_back(r);
        }
        ++it;
    }
    std::vector<std::vector<llama_token>> drafts(n_seq);
    if (!requests.empty()) {
        const int64_t t0 = now_us();
        try {
            std::vector<std::vector<llama_token>> got = s.draft_many(requests);
            for (size_t i = 0; i < requests.size(); ++i) drafts[requests[i].seq_id] = std::move(got[i]);
        } catch (const std::exception & e) {
            // drafts are optional: the step goes on without them (nothing is pending)
            result.draft_error = e.what();
        }
        result.t_draft_us += now_us() - t0;
        result.n_draft_calls = 1;
    }

    // --- ONE target batch (split by n_batch only when it must be) --------------------
    struct Span {
        const StepWork * w;
        int32_t start;  // batch index of the first token
    };
    auto append = [&](BatchData & batch, std::vector<Span> & spans, const StepWork * w) {
        const auto & d = drafts[w->seq];
        spans.push_back({w, static_cast<int32_t>(batch.size())});
        for (size_t i = 0; i < w->tokens.size(); ++i) {
            batch.tokens.push_back(w->tokens[i]);
            batch.pos.push_back(w->pos0 + static_cast<int32_t>(i));
            batch.seq.push_back(w->seq);
            batch.logits.push_back(w->sample && i + 1 == w->tokens.size());
        }
        for (size_t i = 0; i < d.size(); ++i) {
            batch.tokens.push_back(d[i]);
            batch.pos.push_back(w->pos0 + static_cast<int32_t>(w->tokens.size() + i));
            batch.seq.push_back(w->seq);
            batch.logits.push_back(true);
        }
    };
    std::vector<std::pair<int32_t, int32_t>> prompts_done;  // (seq, n_past) of finished prefills
    // decode one batch and verify each of its sequences; the error when the decode failed
    // (then nothing was verified)
    auto decode_and_verify = [&](const BatchData & batch, const std::vector<Span> & spans) -> std::optional<Error> {
        const int64_t t0 = now_us();
        ++result.n_decode_calls;
        try {
            s.decode_target(batch);
            s.process(batch);
        } catch (const std::exception & e) {
            result.t_decode_us += now_us() - t0;
            const auto * err = dynamic_cast<const Error *>(&e);
            return err ? *err : Error(ErrorKind::Decode, e.what());
        }
        result.t_decode_us += now_us() - t0;
        result.n_batch_tokens += static_cast<int32_t>(batch.size());

        // verify each sequence of this batch with its own sampler
        const int64_t t1 = now_us();
        for (const Span & sp : spans) {
            const StepWork & w = *sp.w;
            const auto & d = drafts[w.seq];
            StepOutput out;
            out.seq = w.seq;
            const int32_t n_tok = static_cast<int32_t>(w.tokens.size());
            int32_t n_acc = 0;
            if (w.sample) {
                std::vector<int> idxs(d.size() + 1);
                for (size_t i = 0; i < idxs.size(); ++i) idxs[i] = sp.start + n_tok - 1 + static_cast<int>(i);
                out.tokens = verify(w.seq, idxs, d);
                n_acc = static_cast<int32_t>(out.tokens.size()) - 1;
                if (!d.empty()) s.accept(w.seq, n_acc);
                for (int32_t t : out.tokens) out.pieces.push_back(model.token_to_piece(t, false));
            }
            out.drafted = static_cast<int32_t>(d.size());
            out.accepted = n_acc;
            out.n_past = w.pos0 + n_tok + n_acc;
            if (!d.empty() && n_acc < static_cast<int32_t>(d.size())) {
                s.clear_target_kv(w.seq, out.n_past, -1);
                if (s.draft_context()) s.clear_draft_kv(w.seq, out.n_past, -1);
            }
            if (w.begin) prompts_done.emplace_back(w.seq, out.n_past);
            result.outputs.push_back(std::move(out));
        }
        result.t_verify_us += now_us() - t1;
        return std::nullopt;
    };
    auto fail_span = [&](const Span & sp, const Error & why) {
        if (s.pending(sp.w->seq)) s.accept(sp.w->seq, 0);
        clear_slot(sp.w->seq);
        fail_seq(sp.w->seq, why);
    };
    size_t next = 0;
    while (next < work.size()) {
        BatchData batch;
        std::vector<Span> spans;
        while (next < work.size()) {
            const size_t n = work[next]->tokens.size() + drafts[work[next]->seq].size();
            if (!spans.empty() && batch.size() + n > n_batch) break;
            append(batch, spans, work[next++]);
        }
        const std::optional<Error> failed_batch = decode_and_verify(batch, spans);
        if (!failed_batch) continue;
        if (spans.size() == 1) {
            fail_span(spans[0], *failed_batch);
            continue;
        }
        // one sequence's tokens can fail the whole batch (llama.cpp rejects the batch, or
        // the cache has no room for it): undo what the failed call may have written, then
        // decode each sequence alone so that only the guilty one fails
        for (const Span & sp : spans) {
            s.clear_target_kv(sp.w->seq, sp.w->pos0, -1);
            if (s.draft_context()) s.clear_draft_kv(sp.w->seq, sp.w->pos0, -1);
        }
        ++result.n_isolated_failures;
        for (const Span & sp : spans) {
            BatchData alone;
            std::vector<Span> one;
            append(alone, one, sp.w);
            if (const std::optional<Error> failed = decode_and_verify(alone, one)) fail_span(one[0], *failed);
        }
    }
    // a prompt is complete: start the drafter's generation (every proposal is settled now)
    for (const auto & [seq, n_past] : prompts_done) {
        try {
            std::vector<llama_token> prompt = s.history(seq);
            prompt.resize(std::min<size_t>(prompt.size(), static_cast<size_t>(n_past)));
            s.begin(seq, prompt);
        } catch (const std::exception & e) {
            clear_slot(seq);
            fail_seq(seq, e);
        }
    }
    result.t_total_us = now_us() - t_start;
    return result;
}

}  // namespace engine
