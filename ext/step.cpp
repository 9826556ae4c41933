#include "step.h"

#include <algorithm>
#include <cstdint>

namespace engine {

namespace {

StepError to_step_error(int32_t seq, const std::exception & e) {
    if (const auto * err = dynamic_cast<const Error *>(&e)) {
        return {seq, error_kind_name(err->kind), err->what()};
    }
    return {seq, "SessionError", e.what()};
}

}  // namespace

struct StepRunner::State {
    const StepPlan & plan;
    StepResult result;
    std::vector<bool> failed;                       // per sequence: failed this step, skip the rest
    std::vector<const StepWork *> work;             // valid work items, ascending sequence ids
    std::vector<std::vector<llama_token>> drafts;   // per sequence
    std::vector<int32_t> produced;                  // per sequence: drafts produced before any trim
    std::vector<std::vector<llama_token>> shadows;  // per sequence: its shadow draft (not verified)
    std::optional<Error> decode_error;              // why the last decode_and_verify failed

    State(const StepPlan & p, size_t n_seq)
        : plan(p), failed(n_seq, false), drafts(n_seq), produced(n_seq, 0), shadows(n_seq) {}
};

StepRunner::StepRunner(std::shared_ptr<SpecSession> session)
    : session_(std::move(session)),
      samplers_(session_->config().n_seq),
      unsettled_(session_->config().n_seq) {}

StepResult StepRunner::run(const StepPlan & plan) {
    const int64_t t_start = now_us();
    State st(plan, samplers_.size());
    try {
        settle(st);
        boundary(st);
        select_work(st);
        draft(st);
        decode(st);
    } catch (...) {
        // a proposal nobody will settle must not block the next step
        for (int32_t seq = 0; seq < static_cast<int32_t>(unsettled_.size()); ++seq) {
            if (!unsettled_[seq] && session_->pending(seq)) session_->accept(seq, 0);
        }
        throw;
    }
    st.result.t_total_us = now_us() - t_start;
    return std::move(st.result);
}

void StepRunner::fail_seq(State & st, int32_t seq, const std::exception & e) {
    st.result.errors.push_back(to_step_error(seq, e));
    st.failed[seq] = true;
}

void StepRunner::clear_slot(int32_t seq) {
    session_->check_seq(seq);
    if (session_->pending(seq)) session_->accept(seq, 0);
    unsettled_[seq].reset();
    session_->clear_sequence(seq);
    samplers_[seq].reset();
}

// --- settle: the previous step's verifications, as Python decided ------------------------
void StepRunner::settle(State & st) {
    SpecSession & s = *session_;
    const int32_t n_seq = static_cast<int32_t>(unsettled_.size());
    std::vector<int32_t> keep(n_seq, -1);
    for (const StepSettle & d : st.plan.settles) {
        s.check_seq(d.seq);
        try {
            if (!unsettled_[d.seq]) fail(ErrorKind::InvalidArgument, "no verification to settle on this sequence");
            if (d.n_accepted < 0 || d.n_accepted > unsettled_[d.seq]->n_accepted) {
                fail(ErrorKind::InvalidArgument, "settle keeps " + std::to_string(d.n_accepted) + " drafts of " +
                                                     std::to_string(unsettled_[d.seq]->n_accepted) + " accepted");
            }
            keep[d.seq] = d.n_accepted;
        } catch (const std::exception & e) {
            fail_seq(st, d.seq, e);
        }
    }
    std::vector<std::pair<int32_t, int32_t>> begins;  // (sequence, prompt length)
    for (int32_t seq = 0; seq < n_seq; ++seq) {
        if (!unsettled_[seq]) continue;
        const Unsettled u = *unsettled_[seq];
        unsettled_[seq].reset();
        const int32_t n = keep[seq] >= 0 ? keep[seq] : u.n_accepted;
        try {
            const std::optional<int32_t> proposed = s.pending(seq);
            if (proposed) s.accept(seq, n);
            const int32_t n_past = u.pos_last + 1 + n;
            if (proposed && n < *proposed) {  // rejected drafts, or accepted ones after a stop
                s.clear_target_kv(seq, n_past, -1);
                if (s.draft_context()) s.clear_draft_kv(seq, n_past, -1);
            }
            if (u.begin) begins.emplace_back(seq, n_past);
        } catch (const std::exception & e) {
            clear_slot(seq);
            fail_seq(st, seq, e);
        }
    }
    // every proposal is settled: drafters may begin on the prompts that ended last step
    for (const auto & [seq, n_past] : begins) {
        try {
            std::vector<llama_token> prompt = s.history(seq);
            prompt.resize(std::min<size_t>(prompt.size(), static_cast<size_t>(n_past)));
            s.begin(seq, prompt);
        } catch (const std::exception & e) {
            clear_slot(seq);
            fail_seq(st, seq, e);
        }
    }
}

// --- boundary work: every sequence is quiescent ------------------------------------------
void StepRunner::boundary(State & st) {
    SpecSession & s = *session_;
    const Model & model = *s.target()->model();
    s.require_quiescent();
    for (int32_t seq : st.plan.captures) {
        s.check_seq(seq);
        if (st.failed[seq]) continue;
        try {
            st.result.captures.push_back({seq, s.capture_sequence(seq)});
        } catch (const std::exception & e) {
            fail_seq(st, seq, e);
        }
    }
    for (const StepPark & p : st.plan.parks) {
        s.check_seq(p.seq);
        if (!st.failed[p.seq] && samplers_[p.seq]) parked_.insert_or_assign(p.key, std::move(*samplers_[p.seq]));
        samplers_[p.seq].reset();
    }
    for (uint64_t key : st.plan.drops) parked_.erase(key);
    for (int32_t seq : st.plan.clears) clear_slot(seq);
    for (const StepReuse & r : st.plan.reuses) {
        s.check_seq(r.seq);
        try {  // (settle left nothing pending: keep_prefix refuses a pending proposal)
            unsettled_[r.seq].reset();
            samplers_[r.seq].reset();
            s.keep_prefix(r.seq, r.prefix);
        } catch (const std::exception & e) {
            clear_slot(r.seq);
            fail_seq(st, r.seq, e);
        }
    }
    for (const StepRestore & r : st.plan.restores) {
        clear_slot(r.seq);
        try {
            s.restore_sequence(r.seq, r.state);
        } catch (const std::exception & e) {
            fail_seq(st, r.seq, e);
        }
    }
    for (const StepConfigure & c : st.plan.configures) {
        s.check_seq(c.seq);
        if (st.failed[c.seq]) continue;
        try {
            samplers_[c.seq].emplace(model, c.params);
            samplers_[c.seq]->replay(c.replay_prompt, c.replay_generated);
        } catch (const std::exception & e) {
            samplers_[c.seq].reset();
            fail_seq(st, c.seq, e);
        }
    }
    for (const StepPark & p : st.plan.unparks) {
        s.check_seq(p.seq);
        auto it = parked_.find(p.key);
        try {
            if (it == parked_.end()) fail(ErrorKind::InvalidArgument, "no parked sampler " + std::to_string(p.key));
            if (!st.failed[p.seq]) samplers_[p.seq].emplace(std::move(it->second));
            parked_.erase(it);
        } catch (const std::exception & e) {
            fail_seq(st, p.seq, e);
        }
    }
}

// --- the work items that can run, in the order llama.cpp batches best -------------------
void StepRunner::select_work(State & st) {
    SpecSession & s = *session_;
    const Model & model = *s.target()->model();
    const uint32_t n_batch = s.target()->params().n_batch;
    for (const StepWork & w : st.plan.work) {
        s.check_seq(w.seq);
        if (st.failed[w.seq]) continue;
        try {
            if (w.tokens.empty()) fail(ErrorKind::InvalidArgument, "a work item needs at least one token");
            model.check_tokens(w.tokens, "step");
            if (w.sample && !samplers_[w.seq]) fail(ErrorKind::InvalidArgument, "no sampler configured for the sequence");
            if (w.n_draft > 0 && (w.tokens.size() != 1 || !w.sample)) {
                // drafting continues from a token whose predecessors the drafter has seen
                fail(ErrorKind::InvalidArgument, "only a single-token sampling item may draft");
            }
            if (w.shadow > 0 && (w.tokens.size() != 1 || !w.sample)) {
                fail(ErrorKind::InvalidArgument, "only a single-token sampling item may draft in shadow");
            }
            if (w.tokens.size() + std::max(w.n_draft, 0) > n_batch) {
                fail(ErrorKind::InvalidArgument, "a work item exceeds n_batch");
            }
            st.work.push_back(&w);
        } catch (const std::exception & e) {
            fail_seq(st, w.seq, e);
        }
    }
    // llama.cpp splits a multi-stream batch into one micro-batch per run of ascending
    // sequence ids: out-of-order sequences cost a full forward pass each
    std::stable_sort(st.work.begin(), st.work.end(),
                     [](const StepWork * a, const StepWork * b) { return a->seq < b->seq; });
}

// --- ONE draft call for every drafting sequence ------------------------------------------
void StepRunner::draft(State & st) {
    SpecSession & s = *session_;
    std::vector<DraftRequest> requests;
    for (auto it = st.work.begin(); it != st.work.end();) {
        const StepWork * w = *it;
        if (w->sample && (w->n_draft > 0 || w->shadow > 0)) {
            // (one draft of the longer: its first n_draft tokens are verified, all returned)
            const int32_t n_draft = std::max(w->n_draft, 0);
            DraftRequest r{w->seq, w->pos0, w->tokens.back(), std::max(n_draft, w->shadow),
                           w->shadow > 0 ? n_draft : -1};
            try {
                s.check_draft_request(r);  // one bad request must not fail the others' draft call
            } catch (const std::exception & e) {
                fail_seq(st, w->seq, e);
                it = st.work.erase(it);
                continue;
            }
            requests.push_back(r);
        }
        ++it;
    }
    if (requests.empty()) return;
    const SpecStats & stats = s.stats();
    const uint64_t caught_up = stats.n_caught_up;
    const int64_t t_caught_up = stats.t_catch_up_us;
    const int64_t t0 = now_us();
    try {
        std::vector<std::vector<llama_token>> got = s.draft_many(requests);
        for (size_t i = 0; i < requests.size(); ++i) {
            const DraftRequest & r = requests[i];
            std::vector<llama_token> & d = got[i];
            if (r.n_propose >= 0) {
                st.shadows[r.seq_id] = d;
                d.resize(std::min(d.size(), static_cast<size_t>(r.n_propose)));
            }
            st.drafts[r.seq_id] = std::move(d);
        }
    } catch (const std::exception & e) {
        // drafts are optional: the step goes on without them (nothing is pending)
        st.result.draft_error = e.what();
    }
    // (a draft model catches up on the history it skipped first: its own figures)
    st.result.n_sync_tokens += static_cast<int32_t>(stats.n_caught_up - caught_up);
    st.result.t_catch_up_us += stats.t_catch_up_us - t_caught_up;
    st.result.t_draft_us += now_us() - t0 - (stats.t_catch_up_us - t_caught_up);
    st.result.n_draft_calls = 1;
    // (shadow drafts take no rows)
    requests.erase(
        std::remove_if(requests.begin(), requests.end(), [](const DraftRequest & r) { return r.n_propose == 0; }),
        requests.end());
    size_t shortest = SIZE_MAX;
    for (const DraftRequest & r : requests) {
        st.produced[r.seq_id] = static_cast<int32_t>(st.drafts[r.seq_id].size());
        shortest = std::min(shortest, st.drafts[r.seq_id].size());
    }
    // per-sequence KV streams decode a step in one pass only when every sequence has the same
    // number of rows: every draft is trimmed to the shortest one produced (verification
    // accepts at most what is left: the rest stays proposed)
    if (!s.target()->params().kv_unified) {
        for (const DraftRequest & r : requests) st.drafts[r.seq_id].resize(shortest);
    } else {
        align_rows(st);
    }
}

void StepRunner::align_rows(State & st) {
    const int32_t align = st.plan.output_align;
    if (align <= 1) return;
    // fillers may extend a draft upstream proposed this step up to the item's max_draft
    auto fill_room = [&](const StepWork * w) {
        const auto & d = st.drafts[w->seq];
        return w->sample && !d.empty() ? std::max(0, w->max_draft - static_cast<int32_t>(d.size())) : 0;
    };
    int32_t rows = 0, room = 0, drafted = 0, batch = 0;
    for (const StepWork * w : st.work) {
        const int32_t n_tokens = static_cast<int32_t>(w->tokens.size());
        batch += n_tokens;
        if (!w->sample) continue;
        const int32_t n_drafts = static_cast<int32_t>(st.drafts[w->seq].size());
        rows += 1 + n_drafts;  // (a final prompt chunk needs the logits of its last token only)
        drafted += n_drafts;
        batch += n_drafts;
        room += fill_room(w);
    }
    if (rows < st.plan.align_from || rows % align == 0) return;
    // (fillers past n_batch would split the decode in two: a whole tile never pays that)
    room = std::min(room, static_cast<int32_t>(session_->target()->params().n_batch) - batch);
    int32_t pad = align - rows % align;
    if (pad <= room) {  // round robin over the items with room, then one extension each
        std::vector<int32_t> extra(st.work.size(), 0);
        for (size_t i = 0; pad > 0; i = (i + 1) % st.work.size()) {
            if (extra[i] < fill_room(st.work[i])) ++extra[i], --pad;
        }
        for (size_t i = 0; i < st.work.size(); ++i) {
            if (extra[i] == 0) continue;
            auto & d = st.drafts[st.work[i]->seq];
            d.resize(d.size() + extra[i], d.back());
            session_->extend_proposal(st.work[i]->seq, extra[i]);
        }
        return;
    }
    // no room for a whole tile: drop the partial one, last positions of the longest drafts
    // first (they are accepted least); the dropped tokens stay proposed, never verified
    int32_t cut = rows % align;
    if (cut > drafted) return;
    while (cut > 0) {
        std::vector<llama_token> * longest = nullptr;
        for (const StepWork * w : st.work) {
            auto & d = st.drafts[w->seq];
            if (w->sample && (!longest || d.size() > longest->size())) longest = &d;
        }
        longest->pop_back();
        --cut;
    }
}

// --- ONE target batch (split by n_batch only when it must be), then verification --------
void StepRunner::decode(State & st) {
    SpecSession & s = *session_;
    if (!st.work.empty()) s.set_streaming(st.plan.sync_drafter);
    const uint32_t n_batch = s.target()->params().n_batch;
    auto rows = [&](const StepWork * w) { return w->tokens.size() + st.drafts[w->seq].size(); };
    auto fail_item = [&](const StepWork * w, const Error & why) {
        clear_slot(w->seq);
        fail_seq(st, w->seq, why);
    };
    size_t next = 0;
    while (next < st.work.size()) {
        std::vector<const StepWork *> items;
        size_t n_rows = 0;
        while (next < st.work.size() && (items.empty() || n_rows + rows(st.work[next]) <= n_batch)) {
            n_rows += rows(st.work[next]);
            items.push_back(st.work[next++]);
        }
        if (decode_and_verify(st, items)) continue;
        if (items.size() == 1) {
            fail_item(items[0], *st.decode_error);
            continue;
        }
        // one sequence's tokens can fail the whole batch (llama.cpp rejects the batch, or
        // the cache has no room for it): undo what the failed call may have written, then
        // decode each sequence alone so that only the guilty one fails
        for (const StepWork * w : items) {
            s.clear_target_kv(w->seq, w->pos0, -1);
            if (s.draft_context()) s.clear_draft_kv(w->seq, w->pos0, -1);
        }
        ++st.result.n_isolated_failures;
        for (const StepWork * w : items) {
            if (!decode_and_verify(st, {w})) fail_item(w, *st.decode_error);
        }
    }
}

bool StepRunner::decode_and_verify(State & st, const std::vector<const StepWork *> & items) {
    SpecSession & s = *session_;
    Context & target = *s.target();
    const Model & model = *target.model();
    BatchData batch;
    std::vector<int32_t> first_row;  // batch index of each item's first token
    for (const StepWork * w : items) {
        first_row.push_back(static_cast<int32_t>(batch.size()));
        const auto & d = st.drafts[w->seq];
        for (size_t i = 0; i < w->tokens.size() + d.size(); ++i) {
            const bool is_draft = i >= w->tokens.size();
            batch.tokens.push_back(is_draft ? d[i - w->tokens.size()] : w->tokens[i]);
            batch.pos.push_back(w->pos0 + static_cast<int32_t>(i));
            batch.seq.push_back(w->seq);
            batch.logits.push_back(w->sample && i + 1 >= w->tokens.size());
        }
    }
    const int64_t t0 = now_us();
    ++st.result.n_decode_calls;
    try {
        s.decode_target(batch);
        const int64_t t_p = now_us();
        st.result.n_sync_tokens += s.sync(batch, st.plan.sync_drafter);
        st.result.t_process_us += now_us() - t_p;
    } catch (const std::exception & e) {
        st.result.t_decode_us += now_us() - t0;
        const auto * err = dynamic_cast<const Error *>(&e);
        st.decode_error = err ? *err : Error(ErrorKind::Decode, e.what());
        return false;
    }
    st.result.t_decode_us += now_us() - t0;
    st.result.n_batch_tokens += static_cast<int32_t>(batch.size());

    for (size_t k = 0; k < items.size(); ++k) {
        const StepWork & w = *items[k];
        if (!w.sample) continue;  // a prompt chunk with more to come
        const auto & d = st.drafts[w.seq];
        const int32_t n_tok = static_cast<int32_t>(w.tokens.size());
        std::vector<int> verify_rows(d.size() + 1);
        for (size_t i = 0; i < verify_rows.size(); ++i) verify_rows[i] = first_row[k] + n_tok - 1 + static_cast<int>(i);
        StepOutput out;
        out.seq = w.seq;
        SequenceSampler & sampler = *samplers_[w.seq];
        out.tokens = sampler.verify(target.get(), verify_rows, d);
        if (sampler.n_logprobs() >= 0) {  // the verification's own logits: nothing is decoded again
            for (size_t i = 0; i < out.tokens.size(); ++i) {
                out.logprobs.push_back(token_logprobs(model, llama_get_logits_ith(target.get(), verify_rows[i]),
                                                      out.tokens[i], sampler.n_logprobs()));
            }
        }
        for (int32_t t : out.tokens) out.pieces.push_back(model.token_to_piece(t, sampler.renders_special(t)));
        out.drafted = static_cast<int32_t>(d.size());
        out.produced = st.produced[w.seq];
        out.accepted = static_cast<int32_t>(out.tokens.size()) - 1;
        out.in_sync = s.in_sync(w.seq);
        out.shadow = std::move(st.shadows[w.seq]);
        unsettled_[w.seq] = Unsettled{w.pos0 + n_tok - 1, out.accepted, w.begin};
        st.result.outputs.push_back(std::move(out));
    }
    return true;
}

}  // namespace engine
