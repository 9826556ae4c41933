// Checks made before llama.cpp sees a file or a pairing of models: each stands for an
// abort (GGML_ASSERT / GGML_ABORT) the pinned llama.cpp would otherwise hit.
#include "model.h"

#include "gguf.h"

#include <cstdio>
#include <cstring>
#include <sys/stat.h>

namespace engine {

// ---------------------------------------------------------------------------------------
// GGUF preflight

namespace {

struct GgufCloser {
    void operator()(gguf_context * g) const { gguf_free(g); }
};

// Read an integer KV of any integer type; -1 when absent or not an integer.
int64_t gguf_int(const gguf_context * g, const std::string & key) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) {
        return -1;
    }
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8: return gguf_get_val_u8(g, id);
        case GGUF_TYPE_INT8: return gguf_get_val_i8(g, id);
        case GGUF_TYPE_UINT16: return gguf_get_val_u16(g, id);
        case GGUF_TYPE_INT16: return gguf_get_val_i16(g, id);
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g, id);
        case GGUF_TYPE_INT32: return gguf_get_val_i32(g, id);
        case GGUF_TYPE_UINT64: return static_cast<int64_t>(gguf_get_val_u64(g, id));
        case GGUF_TYPE_INT64: return gguf_get_val_i64(g, id);
        default: return -1;
    }
}

std::vector<int64_t> gguf_int_array(const gguf_context * g, const std::string & key) {
    std::vector<int64_t> out;
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY) {
        return out;
    }
    const size_t n = gguf_get_arr_n(g, id);
    const void * data = gguf_get_arr_data(g, id);
    switch (gguf_get_arr_type(g, id)) {
        case GGUF_TYPE_INT32:
            for (size_t i = 0; i < n; ++i) out.push_back(static_cast<const int32_t *>(data)[i]);
            break;
        case GGUF_TYPE_UINT32:
            for (size_t i = 0; i < n; ++i) out.push_back(static_cast<const uint32_t *>(data)[i]);
            break;
        case GGUF_TYPE_INT64:
            for (size_t i = 0; i < n; ++i) out.push_back(static_cast<const int64_t *>(data)[i]);
            break;
        case GGUF_TYPE_UINT64:
            for (size_t i = 0; i < n; ++i) out.push_back(static_cast<int64_t>(static_cast<const uint64_t *>(data)[i]));
            break;
        default:
            break;
    }
    return out;
}

[[noreturn]] void load_fail(const std::string & path, const std::string & why) {
    fail(ErrorKind::ModelLoad, "cannot load model '" + path + "': " + why);
}

}  // namespace

GgufFacts preflight_gguf(const std::string & path) {
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) {
        load_fail(path, "no such file");
    }
    if (S_ISDIR(st.st_mode)) {
        load_fail(path, "is a directory");
    }
    if (!S_ISREG(st.st_mode)) {
        load_fail(path, "not a regular file");
    }
    if (st.st_size == 0) {
        load_fail(path, "the file is empty");
    }
    {
        char magic[4] = {0, 0, 0, 0};
        FILE * f = std::fopen(path.c_str(), "rb");
        if (f == nullptr) {
            load_fail(path, "cannot open the file for reading");
        }
        const size_t n = std::fread(magic, 1, 4, f);
        std::fclose(f);
        if (n != 4 || std::memcmp(magic, "GGUF", 4) != 0) {
            load_fail(path, "not a GGUF file (bad magic)");
        }
    }
    gguf_init_params gp{/*no_alloc =*/true, /*ctx =*/nullptr};
    std::unique_ptr<gguf_context, GgufCloser> g(gguf_init_from_file(path.c_str(), gp));
    if (!g) {
        load_fail(path, "the GGUF header is truncated or corrupt");
    }

    GgufFacts facts;
    {
        const int64_t id = gguf_find_key(g.get(), "general.architecture");
        if (id < 0 || gguf_get_kv_type(g.get(), id) != GGUF_TYPE_STRING) {
            load_fail(path, "general.architecture is missing");
        }
        facts.arch = gguf_get_val_str(g.get(), id);
    }
    const std::string & a = facts.arch;
    facts.block_count = gguf_int(g.get(), a + ".block_count");
    facts.n_embd = gguf_int(g.get(), a + ".embedding_length");
    facts.target_layers = gguf_int_array(g.get(), a + ".target_layers");
    facts.target_hidden_size = gguf_int(g.get(), a + ".target_hidden_size");
    facts.mask_token_id = gguf_int(g.get(), "tokenizer.ggml.mask_token_id");
    facts.block_size = gguf_int(g.get(), a + ".block_size");

    // tensor data must lie inside the file
    const size_t data_offset = gguf_get_data_offset(g.get());
    const int64_t n_tensors = gguf_get_n_tensors(g.get());
    for (int64_t i = 0; i < n_tensors; ++i) {
        const size_t end = data_offset + gguf_get_tensor_offset(g.get(), i) + gguf_get_tensor_size(g.get(), i);
        if (end > static_cast<size_t>(st.st_size)) {
            load_fail(path, "truncated: tensor '" + std::string(gguf_get_tensor_name(g.get(), i)) +
                                "' extends beyond the end of the file");
        }
        // the CPU ssm_conv kernel asserts an F32 kernel (ops.cpp) at the first decode
        const std::string name = gguf_get_tensor_name(g.get(), i);
        if (name.find("ssm_conv1d") != std::string::npos &&
            gguf_get_tensor_type(g.get(), i) != GGML_TYPE_F32) {
            load_fail(path, "tensor '" + name + "' is " + ggml_type_name(gguf_get_tensor_type(g.get(), i)) +
                                "; llama.cpp requires ssm_conv1d in F32");
        }
    }

    if (a == "eagle3") {
        // src/models/eagle3.cpp asserts a single decoder layer when the graph is built
        if (facts.block_count != 1) {
            load_fail(path, "an EAGLE-3 draft must have block_count 1, this one has " +
                                std::to_string(facts.block_count));
        }
        if (facts.target_hidden_size <= 0) {
            load_fail(path, "eagle3.target_hidden_size is missing");
        }
        if (facts.target_layers.size() != 3) {
            load_fail(path, "an EAGLE-3 draft must name exactly three target extraction layers, this one names " +
                                std::to_string(facts.target_layers.size()));
        }
    }
    if (a == "dflash" || a == "dspark") {
        // without a mask token the first draft aborts in common_batch::get_sub_batch
        if (facts.mask_token_id < 0) {
            load_fail(path, "a DFlash draft needs tokenizer.ggml.mask_token_id");
        }
        if (facts.target_layers.empty()) {
            load_fail(path, a + ".target_layers is missing");
        }
    }
    for (int64_t layer : facts.target_layers) {
        if (layer < 0) {
            load_fail(path, a + ".target_layers holds a negative layer id");
        }
    }
    return facts;
}

std::string vocab_mismatch(const Model & target, const Model & draft) {
    const ModelInfo & t = target.info();
    const ModelInfo & d = draft.info();
    if (t.vocab_type != d.vocab_type) {
        return "vocabulary types differ (" + std::to_string(t.vocab_type) + " vs " + std::to_string(d.vocab_type) + ")";
    }
    if (t.n_vocab != d.n_vocab) {
        return "vocabulary sizes differ (" + std::to_string(t.n_vocab) + " vs " + std::to_string(d.n_vocab) + ")";
    }
    if (t.add_bos != d.add_bos || (t.add_bos && t.bos != d.bos) || t.add_eos != d.add_eos ||
        (t.add_eos && t.eos != d.eos)) {
        return "BOS/EOS tokens differ";
    }
    for (llama_token i = 0; i < t.n_vocab; ++i) {
        if (std::strcmp(llama_vocab_get_text(target.vocab(), i), llama_vocab_get_text(draft.vocab(), i)) != 0) {
            return "token " + std::to_string(i) + " differs";
        }
    }
    return {};
}

void check_draft_pairing(const Model & target, const Model & draft) {
    const ModelInfo & tm = target.info();
    const ModelInfo & dm = draft.info();
    auto incompatible = [](const std::string & why) {
        fail(ErrorKind::IncompatibleContexts, "incompatible contexts: " + why);
    };
    if (dm.arch != "eagle3" && dm.arch != "dflash" && dm.arch != "dspark") {
        return;
    }
    // each check below stands for a GGML_ASSERT/GGML_ABORT the pinned llama.cpp would hit
    if (const std::string why = vocab_mismatch(target, draft); !why.empty()) {
        incompatible("the draft vocabulary differs from the target's: " + why);
    }
    const auto & layers = dm.facts.target_layers;
    if (dm.arch == "eagle3") {
        const bool terminal_nextn = tm.arch == "gpt-oss";
        bool ok = layers.size() == 3 && tm.n_layer > 0;
        for (int64_t l : layers) {
            ok = ok && l >= 0 && (l < tm.n_layer || (l == tm.n_layer && terminal_nextn));
        }
        if (!ok) incompatible("draft must name exactly three supported target extraction sites");
        if (dm.facts.target_hidden_size != tm.n_embd) {
            incompatible("eagle3.target_hidden_size " + std::to_string(dm.facts.target_hidden_size) +
                         " differs from the target's embedding size " + std::to_string(tm.n_embd));
        }
        return;
    }
    for (int64_t l : layers) {
        if (l >= tm.n_layer) {
            incompatible("DFlash target layer " + std::to_string(l) + " is not below the target's " +
                         std::to_string(tm.n_layer) + " layers");
        }
    }
    if (dm.n_embd != tm.n_embd) {
        incompatible("the DFlash draft's embedding size " + std::to_string(dm.n_embd) +
                     " differs from the target's " + std::to_string(tm.n_embd));
    }
}

}  // namespace engine
