#include "spec_session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

namespace engine {

namespace {

[[noreturn]] void incompatible(const std::string & why) {
    fail(ErrorKind::IncompatibleContexts, "incompatible contexts: " + why);
}

// --- the speculative-state container -------------------------------------------------
// magic, version, a digest of the session config, the token history, upstream's opaque
// per-sequence state, and a CRC-32 over everything before it.
constexpr char kStateMagic[4] = {'E', 'S', 'P', 'S'};
constexpr uint32_t kStateVersion = 1;
constexpr size_t kStateMaxBytes = size_t(1) << 30;

uint32_t crc32(const uint8_t * data, size_t n) {
    uint32_t crc = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; ++i) {
        crc ^= data[i];
        for (int k = 0; k < 8; ++k) {
            crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
        }
    }
    return ~crc;
}


struct Writer {
    std::vector<uint8_t> out;
    void bytes(const void * p, size_t n) {
        if (n == 0) return;  // p may be null (an empty vector's data())
        const auto * b = static_cast<const uint8_t *>(p);
        out.insert(out.end(), b, b + n);
    }
    void u32(uint32_t v) { bytes(&v, 4); }
};

struct Reader {
    const std::vector<uint8_t> & in;
    size_t at = 0;
    void need(size_t n) const {
        if (n > in.size() - at) {
            fail(ErrorKind::State, "speculative state is truncated");
        }
    }
    uint32_t u32() {
        need(4);
        uint32_t v;
        std::memcpy(&v, in.data() + at, 4);
        at += 4;
        return v;
    }
    const uint8_t * take(size_t n) {
        need(n);
        const uint8_t * p = in.data() + at;
        at += n;
        return p;
    }
};

}  // namespace

const std::vector<std::string> & spec_types() {
    static const std::vector<std::string> types = {
        "none",      "draft-simple", "draft-eagle3", "draft-dflash", "draft-dspark", "draft-mtp",
        "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"};
    return types;
}

uint32_t spec_config_digest(const SpecConfig & c) {
    uint32_t p_min_bits = 0;
    std::memcpy(&p_min_bits, &c.p_min, sizeof(p_min_bits));
    const std::string key = c.type + "|" + std::to_string(c.n_seq) + "|" + std::to_string(c.n_draft_max) + "|" +
                            std::to_string(c.n_min) + "|" + std::to_string(p_min_bits) + "|" +
                            std::to_string(c.backend_sampling) + "|" + std::to_string(c.ngram_size_n) + "|" +
                            std::to_string(c.ngram_size_m) + "|" + std::to_string(c.ngram_min_hits);
    return crc32(reinterpret_cast<const uint8_t *>(key.data()), key.size());
}

bool spec_type_needs_draft_model(const std::string & t) {
    return t == "draft-simple" || t == "draft-eagle3" || t == "draft-dflash" || t == "draft-dspark";
}

bool spec_type_is_mtp(const std::string & t) { return t == "draft-mtp"; }

std::string spec_batch_error(const SpecConfig & c, int64_t n_batch) {
    const int64_t need = static_cast<int64_t>(c.n_draft_max) + 1;
    if (c.type == "none" || n_batch >= need) return "";
    return "n_batch " + std::to_string(n_batch) + " < n_draft_max + 1 = " + std::to_string(need);
}

void validate_spec_config(const SpecConfig & c) {
    auto bad = [](const std::string & why) { fail(ErrorKind::InvalidConfig, "invalid speculative config: " + why); };
    const auto & types = spec_types();
    if (std::find(types.begin(), types.end(), c.type) == types.end()) {
        std::string all;
        for (const std::string & t : types) all += (all.empty() ? "" : ", ") + t;
        bad("unknown speculative type '" + c.type + "' (known: " + all + ")");
    }
    if (std::string why = n_seq_error(c.n_seq); !why.empty()) bad(why);
    if (c.n_draft_max <= 0) bad("n_draft_max must be > 0, got " + std::to_string(c.n_draft_max));
    if (c.n_draft_max > 1024) bad("n_draft_max must be <= 1024, got " + std::to_string(c.n_draft_max));
    if (c.n_min < 0 || c.n_min > c.n_draft_max) {
        bad("n_min must be in [0, n_draft_max=" + std::to_string(c.n_draft_max) + "], got " + std::to_string(c.n_min));
    }
    if (!(c.p_min >= 0.0f && c.p_min <= 1.0f)) bad("p_min must be in [0, 1]");
    if (c.ngram_size_n < 1 || c.ngram_size_n > 1024) bad("ngram_size_n must be in [1, 1024]");
    if (c.ngram_size_m < 1 || c.ngram_size_m > 1024) bad("ngram_size_m must be in [1, 1024]");
    if (c.ngram_min_hits < 1 || c.ngram_min_hits > 65535) bad("ngram_min_hits must be in [1, 65535]");
}

SpecSession::SpecSession(std::shared_ptr<Context> target, std::shared_ptr<Context> draft, const SpecConfig & config)
    : target_(std::move(target)), draft_(std::move(draft)), config_(config) {
    validate_spec_config(config_);  // config first: a bad config is InvalidConfig, not a context mismatch
    validate_contexts();

    pending_.assign(config_.n_seq, -1);
    history_.assign(config_.n_seq, {});
    results_.assign(config_.n_seq, {});
    in_sync_.assign(config_.n_seq, true);
    if (config_.type == "draft-simple") {
        sync_kind_ = DrafterSync::CatchUp;
    } else if (spec_type_needs_draft_model(config_.type) || spec_type_is_mtp(config_.type)) {
        sync_kind_ = DrafterSync::Stream;
    }
    if (config_.type == "none") {
        return;
    }
    common_params_speculative params;
    params.types = {common_speculative_type_from_name(config_.type)};
    params.draft.n_max = config_.n_draft_max;
    params.draft.n_min = config_.n_min;
    params.draft.p_min = config_.p_min;
    params.draft.backend_sampling = config_.backend_sampling;
    params.draft.ctx_tgt = target_->get();
    params.draft.ctx_dft = draft_ ? draft_->get() : nullptr;
    for (auto * ng : {&params.ngram_simple, &params.ngram_map_k, &params.ngram_map_k4v}) {
        ng->size_n = static_cast<uint16_t>(config_.ngram_size_n);
        ng->size_m = static_cast<uint16_t>(config_.ngram_size_m);
        ng->min_hits = static_cast<uint16_t>(config_.ngram_min_hits);
    }
    try {
        spec_ = common_speculative_init(params, config_.n_seq);
    } catch (const std::exception & e) {
        fail(ErrorKind::Init, std::string("speculative session init failed: ") + e.what());
    }
    if (spec_ == nullptr) {
        fail(ErrorKind::Init, "speculative session init failed for type '" + config_.type + "'");
    }
    // the drafter configures the target's hidden-state extraction itself: ask the context
    // what it turned on rather than guessing from the type name
    const Context::HiddenStates before = target_->hidden_states_at_creation();
    const Context::HiddenStates after = target_->hidden_states();
    need_embd_ = after.post_norm && !before.post_norm;
    need_embd_pre_norm_ = after.pre_norm && !before.pre_norm;
    if (sync_kind_ == DrafterSync::Stream && need_embd_pre_norm_) streamed_ = target_->pre_norm_extraction();
}

void SpecSession::set_streaming(bool on) {
    if (sync_kind_ != DrafterSync::Stream || on == streaming_) return;
    target_->set_pre_norm_extraction(streamed_, on);
    streaming_ = on;
}

SpecSession::~SpecSession() {
    common_speculative_free(spec_);
}

void SpecSession::validate_contexts() {
    const ContextParams & tp = target_->params();
    const ModelInfo & tm = target_->model()->info();
    const std::string & type = config_.type;
    const int32_t need = config_.n_draft_max + 1;  // [id_last, d1..dk] of one sequence

    if (tp.kind != ContextKind::Default) incompatible("the target must be a Default context");
    if (tp.n_seq < config_.n_seq) {
        incompatible("the target context holds " + std::to_string(tp.n_seq) + " sequences, fewer than n_seq " +
                     std::to_string(config_.n_seq));
    }
    if (type != "none") {
        if (std::string why = spec_batch_error(config_, tp.n_batch); !why.empty()) incompatible("target " + why);
        if (static_cast<int64_t>(tp.n_outputs_max_per_seq) < need) {
            incompatible("the target context allows " + std::to_string(tp.n_outputs_max_per_seq) +
                         " outputs per sequence, fewer than n_draft_max + 1 = " + std::to_string(need));
        }
        if ((tm.is_recurrent || tm.is_hybrid) && static_cast<int64_t>(tp.n_rs_seq) < config_.n_draft_max) {
            incompatible("the target is recurrent/hybrid and keeps " + std::to_string(tp.n_rs_seq) +
                         " recurrent snapshots per sequence, fewer than n_draft_max " +
                         std::to_string(config_.n_draft_max) + " (rejected drafts could not be rolled back)");
        }
    }

    const bool needs_draft = spec_type_needs_draft_model(type) || spec_type_is_mtp(type);
    if (!needs_draft) {
        if (draft_) incompatible("speculative type '" + type + "' uses no draft context");
        return;
    }
    if (!draft_) incompatible("speculative type '" + type + "' needs a draft context");
    const ContextParams & dp = draft_->params();
    const ModelInfo & dm = draft_->model()->info();
    if (dp.n_seq != config_.n_seq) {
        incompatible("the draft context holds " + std::to_string(dp.n_seq) + " sequences; it must equal n_seq " +
                     std::to_string(config_.n_seq));
    }
    if (std::string why = spec_batch_error(config_, dp.n_batch); !why.empty()) incompatible("draft " + why);
    if (spec_type_is_mtp(type)) {
        if (dp.kind != ContextKind::Mtp) incompatible("MTP drafting needs an MTP draft context");
        if (draft_->model() != target_->model()) incompatible("the MTP context must be over the target model");
        if (tm.n_layer_nextn <= 0) fail(ErrorKind::Init, "the target model has no NextN/MTP layers");
        return;
    }
    if (dp.kind != ContextKind::Default) incompatible("target and draft must both be Default contexts");
    if (draft_->model() == target_->model() && type != "draft-simple") {
        incompatible("the " + type + " draft must be a separate draft model");
    }
    if (type == "draft-simple") {
        if (const std::string why = vocab_mismatch(*target_->model(), *draft_->model()); !why.empty()) {
            incompatible("the draft vocabulary differs from the target's: " + why);
        }
        if (dm.arch == "eagle3" || dm.arch == "dflash" || dm.arch == "dspark") {
            incompatible("'" + dm.arch + "' drafts need speculative type draft-" + dm.arch + ", not draft-simple");
        }
        return;
    }
    if (draft_->other() != target_) {
        incompatible("the " + type + " draft context must be created with the target context as its other context");
    }
    if (type == "draft-eagle3" && dm.arch != "eagle3") {
        fail(ErrorKind::Init, "the draft model is not an EAGLE-3 model (architecture '" + dm.arch + "')");
    }
    if ((type == "draft-dflash" || type == "draft-dspark") && dm.arch != "dflash" && dm.arch != "dspark") {
        fail(ErrorKind::Init, "the draft model is not a DFlash model (architecture '" + dm.arch + "')");
    }
    check_draft_pairing(*target_->model(), *draft_->model());
}

void SpecSession::check_seq(int64_t seq_id) const {
    if (seq_id < 0 || seq_id >= static_cast<int64_t>(config_.n_seq)) {
        fail_bad_seq(seq_id, config_.n_seq);
    }
}

void SpecSession::require_quiescent() const {
    for (size_t s = 0; s < pending_.size(); ++s) {
        if (pending_[s] >= 0) {
            Error e(ErrorKind::ProposalPending, "sequence " + std::to_string(s) + " still has an unaccepted draft proposal");
            e.seq_id = static_cast<int64_t>(s);
            throw e;
        }
    }
    if (!upstream_quiescent()) {
        fail(ErrorKind::NotQuiescent, "the drafter is in the middle of a draft call (a sequence is still drafting)");
    }
}

bool SpecSession::upstream_quiescent() const {
    // upstream marks each sequence it drafts for and clears the mark when the draft call
    // ends; a mark that survives means a draft call did not complete
    if (spec_ == nullptr) return true;
    for (uint32_t s = 0; s < config_.n_seq; ++s) {
        if (common_speculative_get_draft_params(spec_, static_cast<llama_seq_id>(s)).drafting) return false;
    }
    return true;
}

bool SpecSession::is_quiescent() const {
    return std::all_of(pending_.begin(), pending_.end(), [](int32_t p) { return p < 0; }) && upstream_quiescent();
}

std::optional<int32_t> SpecSession::pending(int32_t seq_id) const {
    check_seq(seq_id);
    if (pending_[seq_id] < 0) return std::nullopt;
    return pending_[seq_id];
}

void SpecSession::record_history(const BatchData & batch) {
    for (size_t i = 0; i < batch.size(); ++i) {
        const int32_t s = batch.seq[i];
        if (s < 0 || s >= static_cast<int32_t>(config_.n_seq)) {
            continue;  // a sequence the target holds beyond the session's n_seq
        }
        auto & h = history_[s];
        const size_t p = static_cast<size_t>(batch.pos[i]);
        if (h.size() > p) h.resize(p);
        if (h.size() < p) h.resize(p, 0);  // positions the session never saw (unknown tokens)
        h.push_back(batch.tokens[i]);
    }
}

void SpecSession::decode_target(const BatchData & batch) {
    target_->decode(batch);
}

void SpecSession::process_checks(const BatchData & batch) {
    target_->validate_batch(batch);
    // upstream reads the target's hidden states row by row for this batch: they must be
    // the outputs of exactly this batch's decode, harvested once
    if (target_->last_batch_processed() || !(target_->last_batch() == batch)) {
        fail(ErrorKind::Process, "process() needs the batch just decoded on the target context "
                                 "(each decoded batch is processed once)");
    }
    target_->mark_last_batch_processed();
    record_history(batch);
    ++stats_.n_process;
}

void SpecSession::process(const BatchData & batch) {
    process_checks(batch);
    if (spec_ == nullptr) return;
    if (!streaming_) {  // (upstream would abort on the missing hidden states)
        fail(ErrorKind::Process, "the target did not extract the drafter's hidden states for this batch");
    }
    const int64_t t0 = now_us();
    bool ok = false;
    try {
        common_batch cb = target_->to_common_batch(batch);
        ok = common_speculative_process(spec_, cb);
    } catch (const std::exception & e) {
        fail(ErrorKind::Process, std::string("speculative process failed: ") + e.what());
    }
    stats_.t_process_us += now_us() - t0;
    if (!ok) fail(ErrorKind::Process, "speculative process failed (see the llama.cpp log)");
}

int32_t SpecSession::sync(const BatchData & batch, bool stream) {
    if (sync_kind_ == DrafterSync::Stream && stream) {
        // the rows of a sequence out of sync land after a gap, which llama.cpp refuses in
        // the draft's own KV cache: what it holds of the sequence is dropped first (it never
        // drafts again; its cache is junk until the sequence is cleared)
        llama_memory_t mem = llama_get_memory(draft_->get());
        if (mem != llama_get_memory(target_->get())) {
            for (int32_t s : batch.seq) {
                if (s >= 0 && s < static_cast<int32_t>(config_.n_seq) && !in_sync_[s]) llama_memory_seq_rm(mem, s, -1, -1);
            }
        }
        process(batch);
        return static_cast<int32_t>(batch.size());
    }
    process_checks(batch);
    if (sync_kind_ == DrafterSync::Stream) {
        for (int32_t s : batch.seq) {
            if (s >= 0 && s < static_cast<int32_t>(config_.n_seq)) in_sync_[s] = false;
        }
    }
    return 0;
}

std::string SpecSession::drafter_sync() const {
    switch (sync_kind_) {
        case DrafterSync::CatchUp: return "catch_up";
        case DrafterSync::Stream: return "stream";
        default: return "none";
    }
}

void SpecSession::catch_up(const std::vector<DraftRequest> & requests) {
    if (sync_kind_ != DrafterSync::CatchUp || spec_ == nullptr) return;
    const int64_t t0 = now_us();
    llama_memory_t mem = llama_get_memory(draft_->get());
    const int32_t n_batch = static_cast<int32_t>(draft_->params().n_batch);
    BatchData batch;
    auto flush = [&] {
        if (batch.size() == 0) return;
        batch.logits.back() = 1;  // (llama.cpp wants one output; the draft call decodes id_last again)
        draft_->decode(batch);
        stats_.n_caught_up += batch.size();
        batch = BatchData{};
    };
    for (const DraftRequest & r : requests) {
        const auto & h = history_.at(r.seq_id);
        const int32_t upto = std::min<int32_t>(r.n_past, static_cast<int32_t>(h.size()));
        const int32_t have = static_cast<int32_t>(llama_memory_seq_pos_max(mem, r.seq_id)) + 1;
        if (have > upto) llama_memory_seq_rm(mem, r.seq_id, upto, -1);
        for (int32_t p = have; p < upto; ++p) {
            if (static_cast<int32_t>(batch.size()) == n_batch) flush();
            batch.tokens.push_back(h[p]);
            batch.pos.push_back(p);
            batch.seq.push_back(r.seq_id);
            batch.logits.push_back(0);
        }
    }
    flush();
    stats_.t_catch_up_us += now_us() - t0;
}

void SpecSession::begin(int32_t seq_id, const std::vector<llama_token> & prompt) {
    check_seq(seq_id);
    require_quiescent();
    const size_t maximum = target_->params().n_ctx;
    if (prompt.size() > maximum) {
        Error e(ErrorKind::PromptTooLong, "prompt has " + std::to_string(prompt.size()) + " tokens, exceeding the " +
                                              std::to_string(maximum) + "-token bound");
        e.size = static_cast<int64_t>(prompt.size());
        e.maximum = static_cast<int64_t>(maximum);
        throw e;
    }
    target_->model()->check_tokens(prompt, "begin");
    history_[seq_id] = prompt;
    ++stats_.n_begin;
    if (spec_ == nullptr || !in_sync_[seq_id]) return;  // (a stream drafter that missed the prompt)
    try {
        common_speculative_begin(spec_, seq_id, prompt);
    } catch (const std::exception & e) {
        fail(ErrorKind::Begin, std::string("speculative begin failed: ") + e.what());
    }
}

std::vector<llama_token> SpecSession::draft(int32_t seq_id, int32_t n_past, llama_token id_last) {
    return draft_many({DraftRequest{seq_id, n_past, id_last, -1}}).front();
}

void SpecSession::check_draft_request(const DraftRequest & r) const {
    const uint32_t n_ctx = target_->params().n_ctx;
    check_seq(r.seq_id);
    if (r.n_propose >= 0 && !can_shadow()) {
        fail(ErrorKind::InvalidArgument, "a '" + config_.type +
                                             "' drafter cannot draft in shadow: its state follows what is verified");
    }
    if (pending_[r.seq_id] >= 0) {
        Error e(ErrorKind::ProposalPending, "sequence " + std::to_string(r.seq_id) + " still has an unaccepted draft proposal");
        e.seq_id = r.seq_id;
        throw e;
    }
    if (r.n_past < 0 || static_cast<uint32_t>(r.n_past) >= n_ctx) {
        fail(ErrorKind::InvalidArgument, "n_past " + std::to_string(r.n_past) + " is outside [0, n_ctx=" +
                                             std::to_string(n_ctx) + ")");
    }
    if (static_cast<size_t>(r.n_past) > history_[r.seq_id].size()) {
        fail(ErrorKind::Draft, "sequence " + std::to_string(r.seq_id) + ": n_past " + std::to_string(r.n_past) +
                                   " exceeds the " + std::to_string(history_[r.seq_id].size()) +
                                   " tokens processed for it");
    }
    target_->model()->check_tokens({r.id_last}, "draft id_last");
}

std::vector<std::vector<llama_token>> SpecSession::draft_many(const std::vector<DraftRequest> & requests) {
    const uint32_t n_ctx = target_->params().n_ctx;
    std::vector<bool> seen(config_.n_seq, false);
    for (const DraftRequest & r : requests) {  // validate all before touching anything
        check_draft_request(r);
        if (seen[r.seq_id]) fail(ErrorKind::InvalidArgument, "sequence " + std::to_string(r.seq_id) + " appears twice");
        seen[r.seq_id] = true;
    }
    std::vector<std::vector<llama_token>> out(requests.size());
    if (spec_ == nullptr) return out;
    catch_up(requests);

    bool any = false;
    for (const DraftRequest & r : requests) {
        // never draft past the end of the context: [id_last, d1..dk] must fit
        int32_t n_max = r.n_max < 0 ? config_.n_draft_max : std::min(r.n_max, config_.n_draft_max);
        n_max = std::min<int32_t>(n_max, static_cast<int32_t>(n_ctx) - r.n_past - 2);
        auto & h = history_[r.seq_id];
        h.resize(static_cast<size_t>(r.n_past));
        results_[r.seq_id].clear();
        if (n_max <= 0 || !in_sync_[r.seq_id]) continue;  // (out of sync: no drafts, no error)
        common_speculative_get_draft_params(spec_, r.seq_id) = {
            /* .drafting = */ true,
            /* .n_max    = */ n_max,
            /* .pos0     = */ r.n_past,
            /* .id_last  = */ r.id_last,
            /* .prompt   = */ &h,
            /* .result   = */ &results_[r.seq_id],
        };
        any = true;
    }
    if (!any) return out;
    const int64_t t0 = now_us();
    try {
        common_speculative_draft(spec_);
    } catch (const std::exception & e) {
        for (const DraftRequest & r : requests) {
            common_speculative_get_draft_params(spec_, r.seq_id).drafting = false;
            results_[r.seq_id].clear();
        }
        fail(ErrorKind::Draft, std::string("speculative draft failed: ") + e.what());
    }
    stats_.t_draft_us += now_us() - t0;
    ++stats_.n_draft_calls;
    // Drafting ran the draft context ahead of the target; roll it back to what the target
    // holds, so verification (process) continues it from n_past (as upstream's loops do).
    if (draft_ && llama_get_memory(draft_->get()) != llama_get_memory(target_->get())) {
        for (const DraftRequest & r : requests) {
            llama_memory_seq_rm(llama_get_memory(draft_->get()), r.seq_id, r.n_past, -1);
        }
    }
    for (size_t i = 0; i < requests.size(); ++i) {
        const int32_t s = requests[i].seq_id;
        out[i] = std::move(results_[s]);
        results_[s].clear();
        const int32_t propose = requests[i].n_propose < 0
                                    ? static_cast<int32_t>(out[i].size())
                                    : std::min(requests[i].n_propose, static_cast<int32_t>(out[i].size()));
        if (propose > 0) {
            pending_[s] = propose;
            ++stats_.n_drafts;
            stats_.n_drafted += static_cast<uint64_t>(propose);
        }
    }
    return out;
}

void SpecSession::require_proposal(int32_t seq_id, const char * verb) const {
    check_seq(seq_id);
    if (pending_[seq_id] < 0) {
        Error e(ErrorKind::NoPendingProposal,
                "sequence " + std::to_string(seq_id) + " has no draft proposal to " + verb);
        e.seq_id = seq_id;
        throw e;
    }
}

void SpecSession::accept(int32_t seq_id, int64_t n_accepted) {
    require_proposal(seq_id, "accept");
    if (n_accepted < 0 || n_accepted > pending_[seq_id]) {
        Error e(ErrorKind::AcceptedTooMany, "accepted " + std::to_string(n_accepted) + " tokens from a " +
                                                std::to_string(pending_[seq_id]) + "-token proposal");
        e.seq_id = seq_id;
        e.accepted = n_accepted;
        e.proposed = pending_[seq_id];
        throw e;
    }
    const int64_t t0 = now_us();
    try {
        common_speculative_accept(spec_, seq_id, static_cast<uint16_t>(n_accepted));
    } catch (const std::exception & e) {
        fail(ErrorKind::Accept, std::string("speculative accept failed: ") + e.what());
    }
    stats_.t_accept_us += now_us() - t0;
    pending_[seq_id] = -1;
    ++stats_.n_accept_calls;
    stats_.n_accepted += static_cast<uint64_t>(n_accepted);
    if (stats_.accepted_per_pos.size() < static_cast<size_t>(n_accepted)) {
        stats_.accepted_per_pos.resize(static_cast<size_t>(n_accepted), 0);
    }
    for (int64_t i = 0; i < n_accepted; ++i) {
        ++stats_.accepted_per_pos[static_cast<size_t>(i)];
    }
}

void SpecSession::extend_proposal(int32_t seq_id, int32_t n) {
    require_proposal(seq_id, "extend");
    if (n < 0) fail(ErrorKind::InvalidArgument, "a proposal cannot be extended by a negative count");
    pending_[seq_id] += n;
}

void SpecSession::print_stats() const {
    common_speculative_print_stats(spec_);
}

std::vector<uint8_t> SpecSession::speculative_state(int32_t seq_id) {
    return spec_container(seq_id, /*require_payload=*/true);
}

std::vector<uint8_t> SpecSession::spec_container(int32_t seq_id, bool require_payload) {
    check_seq(seq_id);
    require_quiescent();
    std::vector<uint8_t> payload;
    bool has_payload = false;
    if (spec_ != nullptr) {
        try {
            has_payload = common_speculative_get_state(spec_, seq_id, payload);
        } catch (const std::exception & e) {
            fail(ErrorKind::State, std::string("speculative state capture failed: ") + e.what());
        }
    }
    if (require_payload && !has_payload) {
        fail(ErrorKind::State, "the '" + config_.type + "' drafter keeps no per-sequence speculative state to capture "
                               "(capture the whole sequence instead)");
    }
    const auto & h = history_[seq_id];
    Writer w;
    w.bytes(kStateMagic, 4);
    w.u32(kStateVersion);
    w.u32(spec_config_digest(config_));
    w.u32(static_cast<uint32_t>(h.size()));
    w.bytes(h.data(), h.size() * sizeof(llama_token));
    w.u32(has_payload ? 1u : 0u);
    w.u32(static_cast<uint32_t>(payload.size()));
    w.bytes(payload.data(), payload.size());
    w.u32(crc32(w.out.data(), w.out.size()));
    if (w.out.size() > kStateMaxBytes) fail(ErrorKind::State, "speculative state exceeds the size bound");
    return std::move(w.out);
}

SpecSession::ParsedState SpecSession::parse_spec_container(const std::vector<uint8_t> & state) const {
    if (state.size() > kStateMaxBytes) fail(ErrorKind::State, "speculative state exceeds the size bound");
    if (state.size() < 4 + 4 * 6 || std::memcmp(state.data(), kStateMagic, 4) != 0) {
        fail(ErrorKind::State, "not a speculative state (bad magic or too short)");
    }
    uint32_t stored_crc;
    std::memcpy(&stored_crc, state.data() + state.size() - 4, 4);
    if (crc32(state.data(), state.size() - 4) != stored_crc) fail(ErrorKind::State, "speculative state checksum mismatch");
    Reader r{state, 4};
    if (r.u32() != kStateVersion) fail(ErrorKind::State, "unsupported speculative state version");
    if (r.u32() != spec_config_digest(config_)) fail(ErrorKind::State, "speculative state was taken with another speculative config");
    ParsedState out;
    const uint32_t n_hist = r.u32();
    if (n_hist > target_->params().n_ctx) fail(ErrorKind::State, "speculative state history exceeds n_ctx");
    out.history.resize(n_hist);
    const uint8_t * hist_bytes = r.take(size_t(n_hist) * sizeof(llama_token));
    if (n_hist > 0) {  // (memcpy from/to null is undefined even for zero bytes: UBSan)
        std::memcpy(out.history.data(), hist_bytes, size_t(n_hist) * sizeof(llama_token));
    }
    target_->model()->check_tokens(out.history, "speculative state history");
    out.has_payload = r.u32() != 0;
    const uint32_t n_payload = r.u32();
    const uint8_t * p = r.take(n_payload);
    out.payload.assign(p, p + n_payload);
    if (r.at + 4 != state.size()) fail(ErrorKind::State, "speculative state has trailing bytes");
    return out;
}

void SpecSession::apply_spec_state(int32_t seq_id, ParsedState parsed) {
    if (parsed.has_payload && spec_ != nullptr) {
        try {
            common_speculative_set_state(spec_, seq_id, parsed.payload);
        } catch (const std::exception & e) {
            fail(ErrorKind::State, std::string("speculative state restore failed: ") + e.what());
        }
    }
    history_[seq_id] = std::move(parsed.history);
}

void SpecSession::restore_speculative_state(int32_t seq_id, const std::vector<uint8_t> & state) {
    check_seq(seq_id);
    require_quiescent();
    apply_spec_state(seq_id, parse_spec_container(state));
}

SequenceState SpecSession::capture_sequence(int32_t seq_id) {
    SequenceState out;
    out.spec = spec_container(seq_id, /*require_payload=*/false);  // checks the id and quiescence first
    out.target = target_->state_seq_get(seq_id, 0);
    if (draft_) out.draft = draft_->state_seq_get(seq_id, 0);
    return out;
}

void SpecSession::restore_sequence(int32_t seq_id, const SequenceState & state) {
    check_seq(seq_id);
    require_quiescent();
    ParsedState parsed = parse_spec_container(state.spec);  // nothing changes before this passed
    if (draft_ && state.draft.empty()) fail(ErrorKind::State, "the sequence state has no draft context section");
    clear_sequence(seq_id);
    try {
        target_->state_seq_set(state.target, seq_id, 0);
        if (draft_) draft_->state_seq_set(state.draft, seq_id, 0);
        apply_spec_state(seq_id, std::move(parsed));
    } catch (...) {
        clear_sequence(seq_id);
        throw;
    }
}

namespace {

// The lowest position a sliding window needs when the next token goes at position n.
void check_window(const Context & ctx, int32_t seq_id, int32_t n, const char * which) {
    const int32_t n_swa = llama_model_n_swa(ctx.model()->get());
    if (n_swa <= 0) return;
    const int64_t pos_min = ctx.seq_pos_min(seq_id);
    if (pos_min > std::max(0, n - n_swa + 1)) {
        fail(ErrorKind::State, std::string("the ") + which + " cache's sliding window no longer holds position " +
                                   std::to_string(std::max(0, n - n_swa + 1)) + " of sequence " +
                                   std::to_string(seq_id) + " (it starts at " + std::to_string(pos_min) + ")");
    }
}

}  // namespace

void SpecSession::keep_prefix(int32_t seq_id, const std::vector<llama_token> & prefix) {
    check_seq(seq_id);
    if (pending_[seq_id] >= 0) fail(ErrorKind::ProposalPending, "sequence " + std::to_string(seq_id) + " has a pending proposal");
    const auto & h = history_[seq_id];
    if (prefix.empty() || prefix.size() > h.size() || !std::equal(prefix.begin(), prefix.end(), h.begin())) {
        fail(ErrorKind::InvalidArgument, "sequence " + std::to_string(seq_id) + " does not hold that prefix (" +
                                             std::to_string(prefix.size()) + " tokens; it holds " +
                                             std::to_string(h.size()) + ")");
    }
    const ModelInfo & tm = target_->model()->info();
    if (tm.is_recurrent || tm.is_hybrid) {
        fail(ErrorKind::State, "a recurrent/hybrid target's state cannot be cut back to a prefix");
    }
    const int32_t n = static_cast<int32_t>(prefix.size());
    check_window(*target_, seq_id, n, "target");
    if (draft_) check_window(*draft_, seq_id, n, "draft");
    clear_target_kv(seq_id, n, -1);
    if (draft_) clear_draft_kv(seq_id, n, -1);
}

void SpecSession::clear_sequence(int32_t seq_id) {
    check_seq(seq_id);
    in_sync_[seq_id] = true;  // (nothing of an empty sequence was missed)
    clear_target_kv(seq_id, -1, -1);
    if (draft_) clear_draft_kv(seq_id, -1, -1);
}

bool SpecSession::clear_target_kv(int64_t seq_id, int64_t p0, int64_t p1) {
    const bool ok = target_->kv_remove(seq_id, p0, p1);
    if (ok && p1 < 0) {
        const size_t keep = static_cast<size_t>(std::max<int64_t>(p0, 0));
        for (size_t s = 0; s < history_.size(); ++s) {
            if ((seq_id < 0 || static_cast<size_t>(seq_id) == s) && history_[s].size() > keep) history_[s].resize(keep);
        }
    }
    return ok;
}

bool SpecSession::clear_draft_kv(int64_t seq_id, int64_t p0, int64_t p1) {
    if (!draft_) fail(ErrorKind::InvalidArgument, "this session has no draft context");
    return draft_->kv_remove(seq_id, p0, p1);
}

}  // namespace engine
