package keying

// The bundled Qwen3 tokenizer's ids of the probe prompt and the probe chat
// (add_generation_prompt), as NewTokenizerCheck(qwen3) computes them:
// TokenizerAuto compares replicas' /tokenize with these before it loads
// the tokenizer (about 23 MiB of heap and a second or two of CPU), so a
// router in front of another model's replicas never loads it.
// TestQwen3ProbeIDs holds them equal to the tokenizer's own.
var (
	qwen3ProbeIDs = []uint32{
		11849, 21123, 45958, 21730, 25, 576, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562,
		13, 220, 16, 17, 18, 19, 20, 21, 22, 488, 220, 23, 24, 284, 220, 16, 17, 18, 19, 21, 20,
		21, 271, 7452, 282, 2075, 982, 286, 470, 856, 334, 17, 220, 671, 94880, 586, 51950, 11,
		75402, 21894, 102819, 11, 27484, 198,
	}
	qwen3ProbeChatIDs = []uint32{
		151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198,
		11849, 21123, 21730, 25, 1128, 374, 220, 16, 17, 10, 18, 15, 5267, 16141, 304, 825,
		3409, 13, 151645, 198, 151644, 77091, 198,
	}
)

// newQwen3ProbeCheck is NewTokenizerCheck(qwen3) without loading it.
func newQwen3ProbeCheck() *TokenizerCheck {
	return &TokenizerCheck{want: qwen3ProbeIDs, wantChat: qwen3ProbeChatIDs}
}
