// Models, contexts and batches. Every method here runs on the executor's native thread.
#pragma once

#include "errors.h"

#include "common.h"
#include "llama.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace engine {

// What a GGUF file says about itself, read before llama.cpp sees the file, so that the
// files the pinned llama.cpp would abort on are refused with a typed error instead.
struct GgufFacts {
    std::string arch;
    int64_t block_count = -1;
    int64_t n_embd = -1;
    std::vector<int64_t> target_layers;  // eagle3 / dflash extraction layers
    int64_t target_hidden_size = -1;     // eagle3
    int64_t mask_token_id = -1;          // dflash
    int64_t block_size = -1;             // dflash
};

GgufFacts preflight_gguf(const std::string & path);

struct ModelParams {
    int32_t n_gpu_layers = 0;
    bool load_mtp = false;  // load NextN/MTP layers (needed for an MTP draft context)
    bool vocab_only = false;
};

struct ModelInfo {
    std::string path;
    std::string arch;
    std::string description;
    int32_t n_vocab = 0, n_embd = 0, n_layer = 0, n_layer_nextn = 0, n_head = 0, n_head_kv = 0;
    int32_t n_ctx_train = 0;
    uint64_t n_params = 0, size = 0, file_size = 0;
    bool is_recurrent = false, is_hybrid = false, has_encoder = false;
    int32_t vocab_type = 0;
    int32_t bos = -1, eos = -1, eot = -1;
    bool add_bos = false, add_eos = false;
    std::vector<int32_t> eog_tokens;
    std::string chat_template;  // empty when the model has none
    std::map<std::string, std::string> metadata;
    GgufFacts facts;
};

class Model {
public:
    Model(const std::string & path, const ModelParams & params);
    ~Model();
    Model(const Model &) = delete;
    Model & operator=(const Model &) = delete;

    llama_model * get() const { return model_; }
    const llama_vocab * vocab() const { return vocab_; }
    const ModelInfo & info() const { return info_; }
    bool vocab_only() const { return vocab_only_; }

    std::vector<llama_token> tokenize(const std::string & text, bool add_special, bool parse_special) const;
    std::string detokenize(const std::vector<llama_token> & tokens, bool remove_special, bool unparse_special) const;
    std::string token_to_piece(llama_token token, bool special) const;
    void check_tokens(const std::vector<llama_token> & tokens, const char * what) const;

private:
    llama_model * model_ = nullptr;
    const llama_vocab * vocab_ = nullptr;
    ModelInfo info_;
    bool vocab_only_ = false;
};

enum class ContextKind { Default = 0, Mtp = 1 };

struct ContextParams {
    uint32_t n_ctx = 4096;
    uint32_t n_batch = 512;
    uint32_t n_ubatch = 512;
    uint32_t n_seq = 1;
    uint32_t n_rs_seq = 0;            // recurrent-state snapshots per sequence (rollback depth)
    uint32_t n_outputs_max = 0;       // 0 = n_batch
    uint32_t n_outputs_max_per_seq = 0;
    int32_t n_threads = 0;            // 0 = all cores
    ContextKind kind = ContextKind::Default;
    bool embeddings = false;
    bool kv_unified = false;
    bool batch_invariant = false;     // every row computed alike whatever the batch holds (CPU)
};

// The most sequences a context serves (llama.cpp's LLAMA_MAX_SEQ), and the one rule on n_seq:
// "" when n_seq is in [1, MAX_SEQ], else why.
inline constexpr int64_t MAX_SEQ = 256;
std::string n_seq_error(int64_t n_seq);

// The rules on a context's sizes (InvalidConfig naming the value): the Context constructor
// applies them, and Python's ContextConfig before anything is loaded.
void validate_context_params(const ContextParams & params);

// Plain token batch, built by Python; turned into a common_batch on the native thread.
struct BatchData {
    std::vector<int32_t> tokens, pos, seq;
    std::vector<uint8_t> logits;
    size_t size() const { return tokens.size(); }
    bool operator==(const BatchData & o) const {
        return tokens == o.tokens && pos == o.pos && seq == o.seq && logits == o.logits;
    }
    int32_t n_outputs() const;
};

class Context {
public:
    // `other`: the target context a draft context reads from (EAGLE-3, DFlash, MTP).
    Context(std::shared_ptr<Model> model, const ContextParams & params, std::shared_ptr<Context> other);
    ~Context();
    Context(const Context &) = delete;
    Context & operator=(const Context &) = delete;

    llama_context * get() const { return ctx_; }
    const std::shared_ptr<Model> & model() const { return model_; }
    const std::shared_ptr<Context> & other() const { return other_; }
    const ContextParams & params() const { return params_; }  // as created (n_ctx etc. resolved)

    // Validate, decode, remember where the outputs are. Returns the number of outputs.
    int32_t decode(const BatchData & batch);
    common_batch to_common_batch(const BatchData & batch) const;
    void validate_batch(const BatchData & batch) const;

    // Outputs of the last decode (valid until the next decode).
    const float * logits() const { return logits_; }
    const float * embeddings() const { return embeddings_; }
    int32_t n_outputs() const { return n_outputs_; }

    // Which hidden states the context extracts besides logits: post-norm embeddings
    // (llama_set_embeddings) and pre-norm ones (layer inputs, the NextN hidden state).
    struct HiddenStates {
        bool post_norm = false;
        bool pre_norm = false;
    };
    HiddenStates hidden_states() const;
    const HiddenStates & hidden_states_at_creation() const { return created_hidden_; }
    // The pre-norm hidden states extracted now (layer inputs by layer, the NextN state), to
    // switch them off while nobody reads them and back on (llama.cpp copies them out of
    // every decoded token).
    struct PreNorm {
        std::vector<uint32_t> layers;
        bool nextn = false, nextn_masked = false;
    };
    PreNorm pre_norm_extraction() const;
    void set_pre_norm_extraction(const PreNorm & which, bool on);

    bool kv_remove(int64_t seq_id, int64_t p0, int64_t p1);
    int64_t seq_pos_min(int32_t seq_id) const;
    int64_t seq_pos_max(int32_t seq_id) const;

    size_t state_seq_size(int32_t seq_id, uint32_t flags);
    std::vector<uint8_t> state_seq_get(int32_t seq_id, uint32_t flags);
    size_t state_seq_set(const std::vector<uint8_t> & data, int32_t seq_id, uint32_t flags);

    void check_seq(int64_t seq_id) const;

    // The batch of the last successful decode, until a speculative session processed it.
    const BatchData & last_batch() const { return last_batch_; }
    bool last_batch_processed() const { return last_batch_processed_; }
    void mark_last_batch_processed() { last_batch_processed_ = true; }

private:
    BatchData last_batch_;
    bool last_batch_processed_ = true;
    std::shared_ptr<Model> model_;
    std::shared_ptr<Context> other_;
    llama_context * ctx_ = nullptr;
    ContextParams params_;
    HiddenStates created_hidden_;
    const float * logits_ = nullptr;
    const float * embeddings_ = nullptr;
    int32_t n_outputs_ = 0;
};

// Refuse a draft model the pinned llama.cpp would abort on with this target (EAGLE-3 and
// DFlash: extraction layers, hidden size, vocabulary). IncompatibleContexts otherwise.
void check_draft_pairing(const Model & target, const Model & draft);

// Are two vocabularies interchangeable for drafting (same type, specials and token texts)?
// Returns an empty string when they are, else why not.
std::string vocab_mismatch(const Model & target, const Model & draft);

}  // namespace engine
