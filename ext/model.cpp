#include "model.h"

#include "llama-context.h"  // (src/) the context's parameters, for hidden_states()

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sys/stat.h>
#include <thread>

namespace engine {

// ---------------------------------------------------------------------------------------
// Model

Model::Model(const std::string & path, const ModelParams & params) {
    GgufFacts facts = preflight_gguf(path);

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = params.n_gpu_layers;
    mp.load_mtp = params.load_mtp;
    mp.vocab_only = params.vocab_only;
    model_ = llama_model_load_from_file(path.c_str(), mp);
    if (model_ == nullptr) {
        fail(ErrorKind::ModelLoad, "cannot load model '" + path +
                                       "': llama.cpp refused the file (unsupported architecture, missing or "
                                       "mis-shaped tensors; see the llama.cpp log)");
    }
    vocab_ = llama_model_get_vocab(model_);

    ModelInfo & in = info_;
    in.path = path;
    in.facts = std::move(facts);
    in.arch = in.facts.arch;
    char buf[512];
    if (llama_model_desc(model_, buf, sizeof(buf)) > 0) {
        in.description = buf;
    }
    in.n_vocab = llama_vocab_n_tokens(vocab_);
    if (!params.vocab_only) {  // a vocab-only model has no hyperparameters to ask about
        in.n_embd = llama_model_n_embd(model_);
        in.n_layer = llama_model_n_layer(model_);
        in.n_layer_nextn = llama_model_n_layer_nextn(model_);
        in.n_head = llama_model_n_head(model_);
        in.n_head_kv = llama_model_n_head_kv(model_);
        in.n_ctx_train = llama_model_n_ctx_train(model_);
        in.n_params = llama_model_n_params(model_);
        in.size = llama_model_size(model_);
        in.is_recurrent = llama_model_is_recurrent(model_);
        in.is_hybrid = llama_model_is_hybrid(model_);
        in.has_encoder = llama_model_has_encoder(model_);
    }
    vocab_only_ = params.vocab_only;
    struct stat st {};
    if (stat(path.c_str(), &st) == 0) {
        in.file_size = static_cast<uint64_t>(st.st_size);
    }
    in.vocab_type = static_cast<int32_t>(llama_vocab_type(vocab_));
    in.bos = llama_vocab_bos(vocab_);
    in.eos = llama_vocab_eos(vocab_);
    in.eot = llama_vocab_eot(vocab_);
    in.add_bos = llama_vocab_get_add_bos(vocab_);
    in.add_eos = llama_vocab_get_add_eos(vocab_);
    for (llama_token t = 0; t < in.n_vocab; ++t) {
        if (llama_vocab_is_eog(vocab_, t)) {
            in.eog_tokens.push_back(t);
        }
    }
    if (const char * tmpl = llama_model_chat_template(model_, nullptr)) {
        in.chat_template = tmpl;
    }
    const int32_t n_meta = llama_model_meta_count(model_);
    std::vector<char> val(1 << 16);
    for (int32_t i = 0; i < n_meta; ++i) {
        if (llama_model_meta_key_by_index(model_, i, buf, sizeof(buf)) < 0) {
            continue;
        }
        const int32_t n = llama_model_meta_val_str_by_index(model_, i, val.data(), val.size());
        if (n >= 0) {
            in.metadata[buf] = std::string(val.data(), std::min<size_t>(n, val.size() - 1));
        }
    }
}

Model::~Model() {
    if (model_ != nullptr) {
        llama_model_free(model_);
    }
}

void Model::check_tokens(const std::vector<llama_token> & tokens, const char * what) const {
    for (size_t i = 0; i < tokens.size(); ++i) {
        if (tokens[i] < 0 || tokens[i] >= info_.n_vocab) {
            fail(ErrorKind::InvalidArgument, std::string(what) + ": token id " + std::to_string(tokens[i]) +
                                                 " at index " + std::to_string(i) + " is outside [0, " +
                                                 std::to_string(info_.n_vocab) + ")");
        }
    }
}

std::vector<llama_token> Model::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    if (text.size() > static_cast<size_t>(INT32_MAX / 2)) {
        fail(ErrorKind::InvalidArgument, "text too long to tokenize");
    }
    std::vector<llama_token> out(text.size() + 2 * add_special + 1);
    int32_t n = llama_tokenize(vocab_, text.data(), static_cast<int32_t>(text.size()), out.data(),
                               static_cast<int32_t>(out.size()), add_special, parse_special);
    if (n < 0) {
        out.resize(static_cast<size_t>(-n));
        n = llama_tokenize(vocab_, text.data(), static_cast<int32_t>(text.size()), out.data(),
                           static_cast<int32_t>(out.size()), add_special, parse_special);
    }
    if (n < 0) {
        fail(ErrorKind::InvalidArgument, "tokenization failed");
    }
    out.resize(static_cast<size_t>(n));
    return out;
}

std::string Model::detokenize(const std::vector<llama_token> & tokens, bool remove_special,
                              bool unparse_special) const {
    check_tokens(tokens, "detokenize");
    std::string out(tokens.size() * 8 + 16, '\0');
    int32_t n = llama_detokenize(vocab_, tokens.data(), static_cast<int32_t>(tokens.size()), out.data(),
                                 static_cast<int32_t>(out.size()), remove_special, unparse_special);
    if (n < 0) {
        out.resize(static_cast<size_t>(-n));
        n = llama_detokenize(vocab_, tokens.data(), static_cast<int32_t>(tokens.size()), out.data(),
                             static_cast<int32_t>(out.size()), remove_special, unparse_special);
    }
    out.resize(static_cast<size_t>(std::max(n, 0)));
    return out;
}

std::string Model::token_to_piece(llama_token token, bool special) const {
    check_tokens({token}, "token_to_piece");
    char buf[256];
    int32_t n = llama_token_to_piece(vocab_, token, buf, sizeof(buf), 0, special);
    if (n < 0) {
        std::string big(static_cast<size_t>(-n), '\0');
        n = llama_token_to_piece(vocab_, token, big.data(), static_cast<int32_t>(big.size()), 0, special);
        big.resize(static_cast<size_t>(std::max(n, 0)));
        return big;
    }
    return std::string(buf, static_cast<size_t>(n));
}

// ---------------------------------------------------------------------------------------
// Context

int32_t BatchData::n_outputs() const {
    int32_t n = 0;
    for (uint8_t l : logits) {
        n += l != 0;
    }
    return n;
}

std::string n_seq_error(int64_t n_seq) {
    if (n_seq >= 1 && n_seq <= MAX_SEQ) return "";
    return "n_seq must be in [1, " + std::to_string(MAX_SEQ) + "], got " + std::to_string(n_seq);
}

void validate_context_params(const ContextParams & params) {
    auto bad = [](const std::string & why) { fail(ErrorKind::InvalidConfig, why); };
    const auto n = [](uint32_t v) { return std::to_string(v); };
    if (std::string why = n_seq_error(params.n_seq); !why.empty()) bad(why);
    if (params.n_ctx < 1) bad("n_ctx must be positive");
    if (params.n_ctx < params.n_seq) {
        bad("n_ctx " + n(params.n_ctx) + " is too small for n_seq " + n(params.n_seq) +
            " (each sequence needs at least one cell)");
    }
    if (params.n_batch < 1) bad("n_batch must be positive");
    if (params.n_ubatch < 1 || params.n_ubatch > params.n_batch) {
        bad("n_ubatch must be in [1, n_batch=" + n(params.n_batch) + "], got " + n(params.n_ubatch));
    }
    if (params.n_threads < 0) bad("threads must be >= 0 (0 = all cores), got " + std::to_string(params.n_threads));
    if (params.n_outputs_max > params.n_batch) bad("n_outputs_max must be <= n_batch");
}

Context::Context(std::shared_ptr<Model> model, const ContextParams & params, std::shared_ptr<Context> other)
    : model_(std::move(model)), other_(std::move(other)), params_(params) {
    const ModelInfo & in = model_->info();
    if (model_->vocab_only()) {
        fail(ErrorKind::Init, "model '" + in.path + "' was loaded vocab-only: it cannot back a context");
    }
    validate_context_params(params);
    if (params.kind == ContextKind::Mtp) {
        if (in.n_layer_nextn <= 0) {
            fail(ErrorKind::Init, "model '" + in.path + "' has no NextN/MTP layers: it cannot back an MTP context");
        }
        if (!other_) {
            fail(ErrorKind::IncompatibleContexts, "an MTP context needs the target context it drafts for");
        }
    }
    if (in.has_encoder && in.arch != "eagle3" && in.arch != "dflash" && in.arch != "dspark") {
        // (EAGLE-3 and DFlash drafts run their own encoder graph inside the session)
        fail(ErrorKind::Init, "encoder-decoder models are not supported");
    }
    if (other_) {
        if (other_->params().kind != ContextKind::Default) {
            fail(ErrorKind::IncompatibleContexts, "incompatible contexts: the other context must be a Default (target) context");
        }
        // the draft graph is reserved when the context is created: check before that
        check_draft_pairing(*other_->model(), *model_);
    } else if (in.arch == "eagle3" || in.arch == "dflash" || in.arch == "dspark") {
        fail(ErrorKind::IncompatibleContexts,
             "incompatible contexts: a " + in.arch + " draft context needs the target context as its other context");
    }

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = params.n_ctx;
    cp.n_batch = params.n_batch;
    cp.n_ubatch = params.n_ubatch;
    cp.n_seq_max = params.n_seq;
    cp.n_rs_seq = params.n_rs_seq;
    cp.n_outputs_max = params.n_outputs_max;
    cp.n_outputs_max_per_seq = params.n_outputs_max_per_seq;
    const int32_t threads = params.n_threads > 0 ? params.n_threads
                                                 : static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.ctx_type = params.kind == ContextKind::Mtp ? LLAMA_CONTEXT_TYPE_MTP : LLAMA_CONTEXT_TYPE_DEFAULT;
    cp.embeddings = params.embeddings;
    cp.kv_unified = params.kv_unified;
    // a GPU build offloads the matrix products of large batches even for CPU weights: not
    // with batch invariance, whose kernels are the CPU's
    cp.op_offload = !params.batch_invariant;
    cp.no_perf = false;
    cp.ctx_other = other_ ? other_->get() : nullptr;
    ctx_ = llama_init_from_model(model_->get(), cp);
    if (ctx_ == nullptr) {
        fail(ErrorKind::Init, "llama.cpp could not create a context for '" + in.path + "' (see the llama.cpp log)");
    }
    llama_set_batch_invariant(ctx_, params.batch_invariant);
    params_.n_ctx = llama_n_ctx(ctx_);
    params_.n_batch = llama_n_batch(ctx_);
    params_.n_ubatch = llama_n_ubatch(ctx_);
    params_.n_seq = llama_n_seq_max(ctx_);
    params_.n_rs_seq = llama_n_rs_seq(ctx_);
    params_.n_threads = threads;
    if (params_.n_outputs_max == 0) {
        params_.n_outputs_max = params_.n_batch;
    }
    if (params_.n_outputs_max_per_seq == 0) {
        params_.n_outputs_max_per_seq = params_.n_outputs_max;
    }
    created_hidden_ = hidden_states();
}

Context::~Context() {
    if (ctx_ != nullptr) {
        llama_free(ctx_);
    }
}

static void check_state_flags(uint32_t flags) {
    // ON_DEVICE takes a path that asserts on foreign bytes; only host-side flags are offered
    if ((flags & ~static_cast<uint32_t>(LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)) != 0) {
        fail(ErrorKind::InvalidArgument, "unsupported state flags " + std::to_string(flags) +
                                             " (use 0 or STATE_SEQ_FLAGS_PARTIAL_ONLY)");
    }
}

void Context::check_seq(int64_t seq_id) const {
    if (seq_id < 0 || seq_id >= params_.n_seq) {
        fail_bad_seq(seq_id, params_.n_seq);
    }
}

void Context::validate_batch(const BatchData & b) const {
    const size_t n = b.size();
    auto bad = [](const std::string & why) { fail(ErrorKind::InvalidArgument, "invalid batch: " + why); };
    if (b.pos.size() != n || b.seq.size() != n || b.logits.size() != n) bad("arrays of different lengths");
    if (n == 0) bad("the batch is empty");
    if (n > params_.n_batch) {
        bad(std::to_string(n) + " tokens exceed n_batch " + std::to_string(params_.n_batch));
    }
    model_->check_tokens(b.tokens, "batch");
    std::vector<uint32_t> per_seq(params_.n_seq, 0);
    uint32_t outputs = 0;
    for (size_t i = 0; i < n; ++i) {
        if (b.seq[i] < 0 || static_cast<uint32_t>(b.seq[i]) >= params_.n_seq) {
            fail_bad_seq(b.seq[i], params_.n_seq);
        }
        if (b.pos[i] < 0 || static_cast<uint32_t>(b.pos[i]) >= params_.n_ctx) {
            bad("position " + std::to_string(b.pos[i]) + " is outside [0, n_ctx=" + std::to_string(params_.n_ctx) + ")");
        }
        if (b.logits[i]) {
            ++outputs;
            if (++per_seq[b.seq[i]] > params_.n_outputs_max_per_seq) {
                bad("more than " + std::to_string(params_.n_outputs_max_per_seq) + " outputs for sequence " +
                    std::to_string(b.seq[i]));
            }
        }
    }
    if (outputs > params_.n_outputs_max) {
        bad(std::to_string(outputs) + " outputs exceed n_outputs_max " + std::to_string(params_.n_outputs_max));
    }
}

common_batch Context::to_common_batch(const BatchData & b) const {
    common_batch cb(ctx_);
    for (size_t i = 0; i < b.size(); ++i) {
        cb.add(b.tokens[i], b.pos[i], b.seq[i], b.logits[i] != 0);
    }
    return cb;
}

int32_t Context::decode(const BatchData & batch) {
    const std::string & arch = model_->info().arch;
    if (params_.kind == ContextKind::Mtp || arch == "eagle3" || arch == "dflash" || arch == "dspark") {
        // these graphs take the target's hidden states as input, which only the session feeds
        fail(ErrorKind::InvalidArgument, "a " + (params_.kind == ContextKind::Mtp ? std::string("MTP") : arch) +
                                             " draft context is driven by its speculative session, not decoded directly");
    }
    validate_batch(batch);
    common_batch cb = to_common_batch(batch);
    last_batch_ = BatchData{};
    logits_ = nullptr;
    embeddings_ = nullptr;
    n_outputs_ = 0;
    const int32_t ret = llama_process(ctx_, LLAMA_PROCESS_TYPE_DECODE, cb.get());
    if (ret != 0) {
        Error e(ErrorKind::Decode, "decode failed with code " + std::to_string(ret) +
                                       (ret == 1 ? " (no KV slot for the batch: the context is full)" : ""));
        e.code = ret;
        throw e;
    }
    last_batch_ = batch;
    last_batch_processed_ = false;
    n_outputs_ = batch.n_outputs();
    if (n_outputs_ > 0) {
        logits_ = llama_get_logits(ctx_);
        if (params_.embeddings) {
            embeddings_ = llama_get_embeddings(ctx_);
        }
    }
    return n_outputs_;
}

Context::HiddenStates Context::hidden_states() const {
    // llama.cpp has setters for these flags but no getters: read its context parameters
    const llama_cparams & cp = ctx_->get_cparams();
    HiddenStates h;
    h.post_norm = cp.embeddings;
    h.pre_norm = cp.embeddings_nextn ||
                 std::any_of(cp.embeddings_layer_inp.begin(), cp.embeddings_layer_inp.end(), [](bool b) { return b; });
    return h;
}

Context::PreNorm Context::pre_norm_extraction() const {
    const llama_cparams & cp = ctx_->get_cparams();
    PreNorm p;
    for (size_t l = 0; l < cp.embeddings_layer_inp.size(); ++l) {
        if (cp.embeddings_layer_inp[l]) p.layers.push_back(static_cast<uint32_t>(l));
    }
    p.nextn = cp.embeddings_nextn;
    p.nextn_masked = cp.embeddings_nextn_masked;
    return p;
}

void Context::set_pre_norm_extraction(const PreNorm & which, bool on) {
    for (uint32_t l : which.layers) llama_set_embeddings_layer_inp(ctx_, l, on);
    if (which.nextn) llama_set_embeddings_nextn(ctx_, on, which.nextn_masked);
}

bool Context::kv_remove(int64_t seq_id, int64_t p0, int64_t p1) {
    if (seq_id < -1 || seq_id >= params_.n_seq) {
        fail_bad_seq(seq_id, params_.n_seq);
    }
    if (p0 > INT32_MAX || p1 > INT32_MAX) {
        fail(ErrorKind::InvalidArgument, "position exceeds the native int32 range");
    }
    return llama_memory_seq_rm(llama_get_memory(ctx_), static_cast<llama_seq_id>(seq_id),
                               static_cast<llama_pos>(std::max<int64_t>(p0, -1)),
                               static_cast<llama_pos>(std::max<int64_t>(p1, -1)));
}

int64_t Context::seq_pos_min(int32_t seq_id) const {
    check_seq(seq_id);
    return llama_memory_seq_pos_min(llama_get_memory(ctx_), seq_id);
}

int64_t Context::seq_pos_max(int32_t seq_id) const {
    check_seq(seq_id);
    return llama_memory_seq_pos_max(llama_get_memory(ctx_), seq_id);
}

size_t Context::state_seq_size(int32_t seq_id, uint32_t flags) {
    check_seq(seq_id);
    check_state_flags(flags);
    return llama_state_seq_get_size_ext(ctx_, seq_id, flags);
}

std::vector<uint8_t> Context::state_seq_get(int32_t seq_id, uint32_t flags) {
    check_seq(seq_id);
    check_state_flags(flags);
    std::vector<uint8_t> out(llama_state_seq_get_size_ext(ctx_, seq_id, flags));
    const size_t n = llama_state_seq_get_data_ext(ctx_, out.data(), out.size(), seq_id, flags);
    out.resize(n);
    return out;
}

size_t Context::state_seq_set(const std::vector<uint8_t> & data, int32_t seq_id, uint32_t flags) {
    check_seq(seq_id);
    check_state_flags(flags);
    if (data.empty()) {
        fail(ErrorKind::State, "empty sequence state");
    }
    const size_t n = llama_state_seq_set_data_ext(ctx_, data.data(), data.size(), seq_id, flags);
    if (n == 0) {
        fail(ErrorKind::State, "llama.cpp rejected the sequence state for sequence " + std::to_string(seq_id));
    }
    return n;
}

}  // namespace engine
